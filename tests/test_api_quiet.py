"""The Python API is as quiet as the CLI: no loading bars or library warnings per stage (issue 17, item 10)."""

import diffusers
import transformers

import memfit


def test_generate_prints_no_library_bars_or_warnings(tiny_models, capfd):
    model = tiny_models("sd")  # built (and its saving bars printed) before the capture
    diffusers.utils.logging.enable_progress_bar()
    diffusers.utils.logging.set_verbosity_warning()
    transformers.utils.logging.enable_progress_bar()
    transformers.utils.logging.set_verbosity_warning()
    try:
        capfd.readouterr()
        memfit.generate("a red circle", model=model, steps=1, width=32, height=32, progress=False)
        out, err = capfd.readouterr()
    finally:
        from memfit.run.libraries import quiet_libraries

        quiet_libraries()  # as conftest left them, whatever the outcome
    assert "Loading" not in err and "it/s" not in err, err
