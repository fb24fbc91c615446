"""A prompt longer than the text encoder takes is cut by the pipeline: memfit says so, once (issue 17, item 6)."""

from memfit.cli.app import main

RUN = ["--steps", "1", "--width", "32", "--height", "32", "--quiet"]


def test_a_cut_prompt_is_reported_once(tiny_models, tmp_path, capsys):
    long_prompt = " ".join(["a red circle on a blue background"] * 30)
    assert main(["generate", "--model", tiny_models("sd"), "--prompt", long_prompt, "--negative-prompt", long_prompt,
                 *RUN, "--out", str(tmp_path / "a.png")]) == 0
    err = capsys.readouterr().err
    assert err.count("memfit: warning:") == 1 and "was cut" in err, err
    assert main(["generate", "--model", tiny_models("sd"), "--prompt", "a red circle", *RUN,
                 "--out", str(tmp_path / "b.png")]) == 0
    assert "warning" not in capsys.readouterr().err
