"""The two native floors stay apart, so a verify-only library (what a server needs) stays possible.

setup.py leaves the lean forward (csrc/forward/: int8 and float products, Llama layers) out when DIVERSED_FORWARD=0.
The build test below builds that library into a temporary folder and loads it in a fresh interpreter with
torch.ops.load_library, without importing diversed_ext (whose full library would register the forward ops, and whose
Python registers their fake kernels): the verify and stats ops must be there, the forward's must not, and a small
verify call must give the tokens a few lines of torch expect. It compiles the verify kernels once (about a minute on
two free cores). The include test is the cheap guard of the same property: neither floor includes the other's files.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from helpers import REPO_ROOT as REPO
CSRC = REPO / "csrc"
VERIFY_OPS = ["verify_probs", "verify_logits", "token_stats", "mix", "value_flags", "philox_uniforms"]
FORWARD_OPS = ["float_pack", "float_linear", "int8_pack", "int8_linear", "int8_llama_layers", "float_llama_layers"]
BUILD_SECONDS = 1200  # a loaded two-core machine compiles the AVX-512 kernels slowly

# Run in the fresh interpreter: loads the library at argv[1], reports which ops it registers and one verify call.
CHILD = """
import json, sys, torch
torch.ops.load_library(sys.argv[1])
problem = torch.load(sys.argv[2])
def registered(name):
    return hasattr(torch.ops.diversed, name) and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"diversed::{name}", "CPU")
tokens, num_accepted, accept_prob = torch.ops.diversed.verify_probs(
    problem["draft_tokens"], problem["draft_probs"], problem["target_probs"], None, None, None, problem["uniforms"],
    None, 0, False, 1.0, None)
print(json.dumps({"registered": {name: registered(name) for name in sys.argv[3:]}, "tokens": tokens.tolist(),
                  "num_accepted": num_accepted.tolist(), "accept_prob": accept_prob.tolist()}))
"""


def verify_problem(batch=3, positions=3, vocab=40):
    """Row 0 accepts every draft (u = 0); row 1 drafts the target's least likely tokens with u near 1 (rejected at
    position 0)."""
    generator = torch.Generator().manual_seed(29)
    draft_probs = torch.randn(batch, positions, vocab, generator=generator).softmax(-1)
    target_probs = torch.randn(batch, positions + 1, vocab, generator=generator).softmax(-1)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=generator).reshape(batch, positions)
    draft_tokens[1] = target_probs[1, :positions].argmin(-1)
    uniforms = torch.rand(batch, positions + 1, generator=generator, dtype=torch.float64)
    uniforms[0, :positions] = 0.0
    uniforms[1, :positions] = 0.999
    return {"draft_tokens": draft_tokens, "draft_probs": draft_probs, "target_probs": target_probs,
            "uniforms": uniforms}


def expected_verify(draft_tokens, draft_probs, target_probs, uniforms):
    """Speculative decoding with w = 1 (nu = p): accept x while u q(x) < p(x), then one token by inverse CDF with
    u_K from the residual max(0, p - q) at the first rejection, or from p after the last draft."""
    batch, positions = draft_tokens.shape
    tokens = torch.full((batch, positions + 1), -1, dtype=torch.int64)
    num_accepted = []
    for b in range(batch):
        k = 0
        while k < positions:
            x = draft_tokens[b, k]
            if not uniforms[b, k] * draft_probs[b, k, x].double() < target_probs[b, k, x].double():
                break
            tokens[b, k] = x
            k += 1
        mass = target_probs[b, k] if k == positions else (target_probs[b, k] - draft_probs[b, k]).clamp(min=0)
        cdf = mass.double().cumsum(0)
        tokens[b, k] = int(torch.searchsorted(cdf, uniforms[b, positions] * cdf[-1], right=True))
        num_accepted.append(k)
    drafted = draft_tokens[..., None]
    ratio = target_probs[:, :positions].gather(-1, drafted) / draft_probs.gather(-1, drafted)
    return tokens, num_accepted, ratio[..., 0].clamp(max=1.0)


def build_verify_only(folder: Path) -> Path:
    env = dict(os.environ, DIVERSED_FORWARD="0", DIVERSED_CUDA="0")
    command = [sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(folder / "temp"),
               "--build-lib", str(folder / "lib")]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=BUILD_SECONDS)
    assert done.returncode == 0, f"the verify-only build failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    libraries = list((folder / "lib" / "diversed_ext").glob("_C*.so"))
    assert len(libraries) == 1, f"expected one library, found {libraries}"
    return libraries[0]


def test_verify_only_build_registers_the_verify_ops_alone(tmp_path):
    library = build_verify_only(tmp_path)
    problem = verify_problem()
    torch.save(problem, tmp_path / "problem.pt")
    child = subprocess.run([sys.executable, "-c", CHILD, str(library), str(tmp_path / "problem.pt"), *VERIFY_OPS,
                            *FORWARD_OPS], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-8000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["registered"] == {**{name: True for name in VERIFY_OPS}, **{name: False for name in FORWARD_OPS}}
    tokens, num_accepted, accept_prob = expected_verify(**problem)
    assert num_accepted[:2] == [3, 0]  # the problem exercises a full acceptance and a first-position rejection
    assert report["num_accepted"] == num_accepted
    assert report["tokens"] == tokens.tolist()
    torch.testing.assert_close(torch.tensor(report["accept_prob"]), accept_prob)


def included_paths(source: Path):
    return re.findall(r'^\s*#\s*include\s+"([^"]+)"', source.read_text(), flags=re.MULTILINE)


def test_forward_and_verify_floors_include_neither_other():
    floors = {"forward": CSRC / "forward", "cpu": CSRC / "cpu", "cuda": CSRC / "cuda"}
    for name, folder in floors.items():
        others = [other for other in floors if other != name]
        for source in sorted(folder.iterdir()):
            for path in included_paths(source):
                assert not any(f"../{other}/" in path for other in others), f"{source.relative_to(REPO)}: {path}"
    shared = [*sorted((CSRC / "common").iterdir()), *sorted((CSRC / "cpu_base").iterdir())]
    for source in shared:
        for path in included_paths(source):
            assert not any(f"../{floor}/" in path for floor in floors), f"{source.relative_to(REPO)} includes {path}"
    schemas = (CSRC / "ops.cpp").read_text()
    assert not [name for name in FORWARD_OPS if f'"{name}(' in schemas], "ops.cpp defines a forward op's schema"
