"""The tokenizer trainer sees no pre-token longer than ``MAX_RUN_CHARS`` (issue 46, item 8): a long
line without whitespace costs the trainer what its first characters cost, and text without such
runs reaches it unchanged (the built-in corpus has none, so its tokenizer and shards are unchanged)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp4lightning.data.tokenizer import MAX_RUN_CHARS, bounded_pieces

#: RSS a tokenizer training on a 2 MB line of letters may add (MB); measured ~1 MB with the cap, 137 MB
#: when the line reached the trainer cut into 64-character words
TRAINING_RSS_MB = 48

# the peak RSS of this process's memory (VmHWM, kB): getrusage's ru_maxrss would do, but Linux carries
# the parent's peak (the test runner's, with torch) over exec into the child's ru_maxrss
_MEASURE = """
import json, random, string
from fp4lightning.data.tokenizer import Tokenizer

def peak_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

line = "".join(random.Random(0).choices(string.ascii_letters, k=2_000_000))
before = peak_kb()
tok = Tokenizer.train([line, "plain text and more plain text " * 200], vocab_size=300)
after = peak_kb()
assert tok.decode(tok.encode(line[:3000], bos=False)) == line[:3000]
print(json.dumps({"added_mb": (after - before) / 1024}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the peak RSS from Linux's /proc")
def test_a_long_line_without_whitespace_trains_in_bounded_memory():
    """Peak RSS of training on a 2 MB line of letters (one pre-token), in a fresh process."""
    env = {**os.environ, "RAYON_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    added = json.loads(proc.stdout.strip().splitlines()[-1])["added_mb"]
    assert added < TRAINING_RSS_MB, added


def test_long_pre_tokens_reach_the_trainer_as_their_first_characters():
    letters = "abcdefghij" * 50  # one pre-token of 500 letters
    digits = "0123456789" * 20
    spaces = " " * 300
    text = f"Plain words here, {letters} and then{spaces}x {digits}."
    pieces = list(bounded_pieces([text]))
    assert "".join(pieces) == (f"Plain words here," + f" {letters}"[:MAX_RUN_CHARS] + " and then"
                               + spaces[:MAX_RUN_CHARS] + " x" + f" {digits}"[:MAX_RUN_CHARS] + ".")
    # each cut pre-token is a piece of its own, so no merge joins it to its neighbours
    assert {f" {letters}"[:MAX_RUN_CHARS], spaces[:MAX_RUN_CHARS], f" {digits}"[:MAX_RUN_CHARS]} <= set(pieces)


def test_text_without_long_pre_tokens_is_unchanged():
    """Prose, words of 64 characters (a leading space counts), and Chinese without spaces (a long run of short pre-tokens: the
    punctuation starts new ones) reach the trainer whole."""
    chinese = "我们今天去公园散步，天气很好。" * 400
    texts = ["The quick brown fox jumps over the lazy dog. " * 3000, "x" * 64 + " and " + "y" * 63, chinese,
             "a1b2c3" * 1000]
    for text in texts:
        assert "".join(bounded_pieces([text])) == text
