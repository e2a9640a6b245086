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
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's CLI (``argv`` defaults to ``sys.argv[1:]``) with our model registered."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    import fp4lightning.eval.lm  # noqa: F401  (registers the "fp4lightning" model)
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
