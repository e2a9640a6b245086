"""lm-eval's own command line with the ``fp4lightning`` model registered.

lm-eval 0.4.13's CLI resolves ``--model`` in a fixed table and has no plugin or entry-point
group for models, so the stock ``lm_eval`` script cannot find ours. This wraps
``lm_eval.__main__.cli_evaluate`` after importing :mod:`fp4lightning.eval.lm` (which
registers the model); it is installed as the console script ``fp4lightning-lm-eval``
(docs/evaluation.md). Every lm-eval option works as usual, for example::

    fp4lightning-lm-eval run --model fp4lightning \\
        --model_args pretrained=runs/tiny/checkpoints/last.ckpt,linear=fp4 --batch_size 8 \\
        --tasks fp4l_offline --include_path data/builtin/eval_tasks --output_path results/

    python -m fp4lightning.eval.lm_eval_cli run --model fp4lightning \\
        --model_args pretrained=runs/tiny/checkpoints/last.ckpt --tasks hellaswag,piqa

Hub tasks need huggingface.co (or a filled HF cache); with neither, set ``HF_HUB_OFFLINE=1``
``HF_DATASETS_OFFLINE=1`` so they fail at once instead of retrying. The paper's evaluation
(arXiv 2501.17116, section 7) is lm-eval's zero-shot setting: no ``--num_fewshot``.

Without ``--device`` (on the command line or in a ``--config`` YAML) it evaluates on CUDA where there
is a GPU and on the CPU elsewhere (lm-eval's own default is ``cuda:0``).
"""

from __future__ import annotations

import sys

__all__ = ["main", "with_available_device"]


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's CLI (``argv`` defaults to ``sys.argv[1:]``) with our model registered."""
    sys.argv = [sys.argv[0], *with_available_device(sys.argv[1:] if argv is None else argv)]
    from fp4lightning.eval.lm import quiet_git_hash  # registers the "fp4lightning" model
    from lm_eval.__main__ import cli_evaluate

    with quiet_git_hash():
        cli_evaluate()


def with_available_device(argv: list[str]) -> list[str]:
    """``argv`` with ``--device cpu`` added to an evaluation that names no device on a machine without
    CUDA: lm-eval's own default is ``cuda:0``, and the model then said it fell back to the CPU although
    no device was asked for. A device on the command line or in the ``--config`` YAML is left alone."""
    import torch

    command = argv[0] if argv else ""
    evaluates = command == "run" or (command.startswith("-") and command not in ("-h", "--help"))
    if not evaluates or torch.cuda.is_available() or any(a == "--device" or a.startswith("--device=") for a in argv):
        return list(argv)
    if "device" in _config_file(argv):
        return list(argv)
    return [*argv, "--device", "cpu"]


def _config_file(argv: list[str]) -> dict:
    """The ``--config`` / ``-C`` YAML of an lm-eval command line (empty when none is given or readable:
    lm-eval reports that itself)."""
    import yaml

    for i, a in enumerate(argv):
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
        elif a in ("--config", "-C") and i + 1 < len(argv):
            path = argv[i + 1]
        else:
            continue
        try:
            with open(path) as f:
                loaded = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            return {}
        return loaded if isinstance(loaded, dict) else {}
    return {}


if __name__ == "__main__":
    main()
