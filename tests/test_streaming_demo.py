"""The documented way to see memfit stream (issue 35, item 17): the command in docs/getting-started.md,
run as written on the built-in demo model, streams the UNet and its report says so."""

import re
import shlex
from pathlib import Path

from memfit.cli.app import main

GETTING_STARTED = Path(__file__).resolve().parents[1] / "docs" / "getting-started.md"


def _documented_command() -> list[str]:
    """The command after the streaming-demo marker, split as a shell would."""
    text = GETTING_STARTED.read_text()
    block = re.search(r"<!-- streaming-demo:.*?-->\s*```bash\n(.*?)\n```", text, re.DOTALL)
    assert block, f"{GETTING_STARTED} has no streaming-demo command"
    words = shlex.split(block.group(1))
    assert words[0] == "memfit", words
    return words[1:]


def test_the_documented_streaming_command_streams_the_unet(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # --out streamed.png lands here
    assert main(_documented_command()) == 0
    out = capsys.readouterr().out
    assert "above what this process holds as each stage starts" in out, out
    denoise = re.search(r"plan denoise: ([\d.]+ \w+) resident, .* streamed from host, ([\d.]+) (\w+) streamed from disk",
                        out)
    assert denoise, out
    assert float(denoise.group(2)) > 0 and denoise.group(3) in ("KiB", "MiB"), denoise.group(0)
    assert (tmp_path / "streamed.png").is_file()


def test_a_budget_on_top_of_the_process_below_the_floor_names_the_one_that_works(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--device", "cpu", "--prompt", "a red circle", "--budget", "+20MiB", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "The budget of +20.00 MiB is below the smallest that can work" in err, err
    assert re.search(r"Give --budget \+\d+MiB or more", err), err
    assert not (tmp_path / "memfit.png").exists()
