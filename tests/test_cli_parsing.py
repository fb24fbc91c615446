"""The command line's own parsing: a mistyped flag gets the closest one, --debug goes anywhere."""

import pytest

from memfit.cli.app import main


def test_a_mistyped_flag_names_the_closest_one_with_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--stpes", "3"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "usage: memfit generate" in err and "--stpes (did you mean --steps?)" in err
    with pytest.raises(SystemExit):
        main(["cache", "ls", "--jsn"])
    err = capsys.readouterr().err
    assert "usage: memfit cache ls" in err and "--jsn (did you mean --json?)" in err


@pytest.mark.parametrize("argv", [["--debug", "generate"], ["generate", "--debug"]])
def test_debug_shows_the_traceback_before_or_after_the_subcommand(argv):
    from memfit.errors import MemfitError

    with pytest.raises(MemfitError, match="Nothing to draw"):
        main(argv)


def test_without_debug_a_refusal_is_one_sentence(capsys):
    assert main(["generate"]) == 2
    assert capsys.readouterr().err.startswith("memfit: error: Nothing to draw")


def test_cache_ls_says_where_a_summary_was_cut(tmp_path, monkeypatch, capsys):
    from memfit.cache.key import CacheKey
    from memfit.cache.store import CacheStore

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    CacheStore(tmp_path).put(CacheKey("embeddings", {"prompt": "a lighthouse at dusk over a stormy sea, oil"}), b"1")
    assert main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert "..." in out and "`memfit cache ls --json` gives them whole" in out
