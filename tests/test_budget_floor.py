"""A budget below the minimum is refused once, naming a budget that works (issue 17, item 9)."""

import re

import pytest

from memfit.cli.app import main

RUN = ["--prompt", "a red circle", "--steps", "1", "--width", "32", "--height", "32", "--quiet"]


@pytest.mark.slow
def test_the_first_refusal_names_a_budget_that_works(tiny_models, tmp_path, capsys):
    out = tmp_path / "a.png"
    assert main(["generate", "--model", tiny_models("sd"), *RUN, "--budget", "1MiB", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    named = re.search(r"Give --budget (\d+)MiB or more", err)
    assert named, err
    assert not out.exists()
    assert main(["generate", "--model", tiny_models("sd"), *RUN, "--budget", f"{named.group(1)}MiB",
                 "--out", str(out)]) == 0, capsys.readouterr().err
