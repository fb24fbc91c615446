"""The arguments ``memfit generate``, ``memfit serve`` and ``memfit batch`` share: the model, how it
loads, and how it runs (budget, backend). One definition, so the three commands take the same flags."""

from __future__ import annotations

import argparse

from memfit.compile.backends.registry import list_backends

__all__ = ["COMPONENT_HELP", "CONFIG_HELP", "QUANTIZE_HELP", "THREADS_HELP", "add_model_args", "add_run_args", "check_budget",
           "check_model_args", "parse_components", "parse_quantize", "run_options"]

BUDGET_HELP = ("memory budget for each stage (the process, weights and activations): auto (default: what this machine, "
               "container or GPU can spare now), none (no planning), a size such as 2GiB or 6GB (=6*10^9 bytes), or "
               "+SIZE for what each stage adds on top of the process (its weights and activations), e.g. +64MiB")

THREADS_HELP = ("threads torch computes with (default: the CPUs this process may use: its affinity and cgroup CPU quota, "
                "less those other processes keep busy; OMP_NUM_THREADS where set); the report says which")


CONFIG_HELP = ("for a checkpoint file: a diffusers folder of its family to read configs, scheduler and tokenizers "
               "from (never its weights); default: the Hugging Face cache's copy of the family's repository, or "
               "those small files fetched once when online")


COMPONENT_HELP = ("replace one component of the model by a single file of its own, e.g. vae=sdxl_vae.safetensors "
                  "(a UNet, VAE or CLIP text encoder, in its original or diffusers layout); repeatable")


QUANTIZE_HELP = ("quantize one component of the model on the fly, once (kept in memfit's cache), e.g. "
                 "transformer=q8_0; TYPE: fp8, int8 (weight-only, a scale per row), q8_0, q6_k, q5_k, q5_1, "
                 "q5_0, q4_1, q4_0, q4_k, q3_k, q2_k (GGUF blocks); repeatable")


def _parse_pairs(values: list[str] | None, flag: str, metavar: str, example: str) -> dict[str, str] | None:
    """{name: value} from ``flag`` NAME=VALUE flags (``metavar``: NAME=FILE); None when there are none."""
    from memfit.errors import MemfitError

    pairs: dict[str, str] = {}
    for item in values or ():
        name, equals, value = item.partition("=")
        name = name.strip()
        if not equals or not name or not value:
            raise MemfitError(f"{flag} {item}: give {metavar}, e.g. {flag} {example}.")
        if name in pairs:
            raise MemfitError(f"{flag} {name} is given twice ({pairs[name]} and {value}); give each component once.")
        pairs[name] = value
    return pairs or None


def parse_components(values: list[str] | None) -> dict[str, str] | None:
    """{name: file} from --component NAME=FILE flags; None when there are none."""
    return _parse_pairs(values, "--component", "NAME=FILE", "vae=sdxl_vae.safetensors")


def parse_quantize(values: list[str] | None) -> dict[str, str] | None:
    """{name: type} from --quantize NAME=TYPE flags; None when there are none."""
    return _parse_pairs(values, "--quantize", "NAME=TYPE", "transformer=q8_0")


def check_budget(value: str) -> None:
    """Refuse a --budget that is neither auto, none nor a size, before a command imports torch (seconds); the run
    resolves a good one itself (memfit.plan.budget.resolve_budget), with the same sentence for a bad one."""
    from memfit.plan.budget import AUTO, NONE, Budget, above_process_size

    if value.strip().lower() not in (AUTO, NONE):
        Budget.of(above_process_size(value) or value)


def check_model_args(args: argparse.Namespace) -> None:
    """Refuse a --model that does not exist and a malformed --component before a command imports torch (seconds);
    opening the model checks the rest."""
    from memfit.models.locate import refuse_missing_model

    if args.model is not None:
        refuse_missing_model(args.model)
    parse_components(args.component)
    parse_quantize(args.quantize)


def add_model_args(parser: argparse.ArgumentParser, *, model_help: str = "", several_configs: bool = False) -> None:
    """--model, --config, --component, --dtype, --device and --allow-pickle: which model, and how it loads.
    ``model_help`` is added to --model's help; ``several_configs`` makes --config repeatable (a list): each file takes
    the first folder of its family whose models are its own (memfit.models.library)."""
    parser.add_argument("--model", help="diffusers model folder, or an all-in-one checkpoint file (.safetensors, "
                        "as AUTOMATIC1111 and ComfyUI keep them) (default: memfit's built-in demo model)"
                        + (f"; {model_help}" if model_help else ""))
    if several_configs:
        parser.add_argument("--config", metavar="DIR", action="append",
                            help=CONFIG_HELP + "; repeatable: each file takes the first folder of its family whose models are "
                            "the file's (its transformer's shapes, Wan 2.2's second expert)")
    else:
        parser.add_argument("--config", metavar="DIR", help=CONFIG_HELP)
    parser.add_argument("--component", action="append", metavar="NAME=FILE", help=COMPONENT_HELP)
    parser.add_argument("--quantize", action="append", metavar="NAME=TYPE", help=QUANTIZE_HELP)
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="run dtype (default fp32)")
    parser.add_argument("--device", help="torch device, e.g. cpu or cuda:0 (default: cuda if available)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="load pickle checkpoints (.bin, .pt, .pth, .ckpt) with torch's weights_only loader; "
                        "refused by default (convert them to safetensors instead)")


def add_run_args(parser: argparse.ArgumentParser, *, budget_note: str = "", **model_args) -> None:
    """add_model_args (``model_args`` its keywords), then --budget (``budget_note`` says what the command does
    with it), --backend (the backends the registry knows, built-in and installed), --fallback and --threads."""
    add_model_args(parser, **model_args)
    parser.add_argument("--budget", default="auto", help=BUDGET_HELP + (f"; {budget_note}" if budget_note else ""))
    parser.add_argument("--backend", help=f"compile with a backend: NAME ({', '.join(list_backends())}) or per "
                        "component, e.g. unet=openvino,vae=eager")
    parser.add_argument("--fallback", choices=("eager",), help="if a backend fails on a component, run it eagerly "
                        "(reported)")
    # A string, checked by run_options: a bad count is memfit's one sentence, not argparse's usage text.
    parser.add_argument("--threads", metavar="N", help=THREADS_HELP)


def run_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of add_run_args' flags, as memfit.generate, Session and BatchOptions take them."""
    from memfit.compile.entry_points import parse_backend_arg
    from memfit.run.threads import check_threads

    return {"model": args.model, "config": args.config, "components": parse_components(args.component),
            "quantize": parse_quantize(args.quantize),
            "dtype": args.dtype, "device": args.device, "allow_pickle": args.allow_pickle,
            "budget": args.budget, "backend": parse_backend_arg(args.backend) if args.backend else None,
            "fallback": args.fallback, "threads": check_threads(args.threads)}
