"""``import fp4lightning`` before torch sets ``OMP_WAIT_POLICY=PASSIVE`` unless the user set it.

OpenMP threads that spin while they wait make a CPU step several times slower on a shared machine;
``scripts/main.sh`` exports the variable, and the package sets the same default for users' own code
(fp4lightning/__init__.py). torch's OpenMP runtime reads it when torch is imported, so with torch
imported first the package changes nothing (the docs say to export it then).
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOW = "import os, sys; {imports}; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"


def _policy_after(imports: str, user_value: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if user_value is not None:
        env["OMP_WAIT_POLICY"] = user_value
    proc = subprocess.run([sys.executable, "-c", SHOW.format(imports=imports)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_import_sets_passive_before_torch_exists():
    # the package itself does not import torch, so torch, imported next, starts with PASSIVE
    assert _policy_after("import fp4lightning") == "PASSIVE False"
    assert _policy_after("import fp4lightning; import torch") == "PASSIVE True"


def test_a_value_the_user_set_is_kept():
    assert _policy_after("import fp4lightning", user_value="ACTIVE") == "ACTIVE False"


def test_torch_imported_first_is_left_alone():
    # too late for this process's OpenMP runtime: the environment would claim a policy it does not have
    assert _policy_after("import torch; import fp4lightning") == "None True"
