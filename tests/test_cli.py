"""The command line: one error policy for every subcommand, --help without torch/Lightning."""

import subprocess
import sys
from pathlib import Path

import pytest

from fp4lightning.cli import COMMANDS, main
from fp4lightning.errors import EXIT_USAGE, UserError, run_command

# runs the CLI's --help in a fresh interpreter, then reports which heavy modules it loaded
_HELP_PROBE = """
import sys
from pathlib import Path
from fp4lightning.cli import main
try:
    main({argv!r})
except SystemExit as e:
    assert e.code == 0, e.code
heavy = sorted(m for m in ("torch", "lightning", "numpy", "lm_eval", "triton") if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


@pytest.mark.parametrize("argv", [["--help"]] + [[c.name, "--help"] for c in COMMANDS] + [["data", "prepare", "--help"]])
def test_help_imports_no_heavy_module(argv):
    proc = subprocess.run([sys.executable, "-c", _HELP_PROBE.format(argv=argv)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: fp4lightning" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY=", proc.stdout.splitlines()[-1]


def test_compare_bad_variant_is_one_line_exit_2(capsys):
    tiny = Path(__file__).parents[1] / "recipes" / "tiny.yaml"
    assert main(["compare", str(tiny), "--variants", "fp3"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp4lightning compare: error: unknown variant 'fp3'"), err
    assert "bf16" in err[0]  # names the valid choices


def test_bug_keeps_its_traceback():
    def buggy(_):
        raise KeyError("internal")

    with pytest.raises(KeyError):
        run_command("fp4lightning x", buggy, None)


def test_user_error_classes_share_the_base():
    from fp4lightning.checkpoint import CheckpointError
    from fp4lightning.data import DataCorruptError, DataNotPreparedError, DataSourceError
    from fp4lightning.eval.run import HubUnavailableError
    from fp4lightning.initialize import InitError
    from fp4lightning.recipe import RecipeError

    for cls in (CheckpointError, DataCorruptError, DataNotPreparedError, DataSourceError, HubUnavailableError,
                InitError, RecipeError):
        assert issubclass(cls, UserError), cls
