"""`kvflow bench spec-decode --draft-shape NAME --forced-acceptance`: a random-weight draft
of a preset's shape, every draft accepted, and the whole speculative step's cost."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from serve_harness import KVFLOW


def test_forced_acceptance_accepts_every_draft_of_a_shape_draft(tiny_model_dir: Path) -> None:
    command = [str(KVFLOW), "bench", "spec-decode", "--config", str(tiny_model_dir)]
    command += ["--methods", "draft_model", "--draft-shape", "smollm2-135m"]
    command += ["--forced-acceptance", "--dataset", "random", "--num-random-prompts", "1"]
    command += ["--output-len", "11", "--num-speculative-tokens", "4", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    none, draft = json.loads(done.stdout.strip().splitlines()[-1])["results"]
    assert none["name"] == "none" and none["output_tokens"] == 11
    # Two steps of 4 drafts + 1 bonus token reach 10 tokens; random weights would agree
    # on almost none of those 8 drafts.
    assert draft["output_tokens"] == 11 and draft["drafts"] >= 2
    assert draft["acceptance_rate"] == 1.0 and draft["mean_acceptance_length"] == 5.0
    assert draft["step_cost"] > 0


def test_a_shape_draft_needs_random_target_weights(tiny_model_dir: Path) -> None:
    command = [str(KVFLOW), "bench", "spec-decode", "--model", str(tiny_model_dir)]
    command += ["--methods", "draft_model", "--draft-shape", "smollm2-135m"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "--shape or --config" in done.stderr


def test_forced_acceptance_needs_a_draft_model_alone(tiny_model_dir: Path) -> None:
    # An n-gram draft is not the target's choice: zeroed norms would not force it.
    command = [str(KVFLOW), "bench", "spec-decode", "--config", str(tiny_model_dir)]
    command += ["--methods", "ngram", "--forced-acceptance"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "--methods draft_model alone" in done.stderr
