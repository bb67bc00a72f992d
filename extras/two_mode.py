"""Theorem 4.3 in the real trainer: a task where Eq. 4 predicts a large lift from the branch guide,
sage.py trained on it arm by arm, and each trained pi(B) held against its exact prediction.

    python -m extras.two_mode --out runs/two-mode               # the study (docs/two-mode.md)
    python -m extras.two_mode --predict-only --out runs/two-mode  # the SFT starts and predictions
    python -m extras.two_mode --tiny    # make demo: one seed, four arms, K = 3, M = 8, 2 minutes

The task, built by code as the demo's is. Every prompt asks the same thing in one of a few
phrasings. A completion first picks a mode, then writes K digits:

    A (pi_ref about 0.95), then K digits, each 0 (0.97) or 1 (0.03): right only if all are 0;
    B (pi_ref about 0.05), then K digits, each one of M near-even choices: always right.

B's positions have entropy about ln M > tau, so the branch guide (Eq. 11) raises the anchor there
by q = 1 + ratio (ln M - tau) per position; its tokens do not change the reward, so RL does not
sharpen them and the policy's own q stays there too. A position's q is one number for all its
tokens, so it cancels from its own choice; it enters pi(B) at the root through B's soft value.
With k1 in the return the fixed point is Eq. 4 itself, and

    pi(B) = pB q^K / (pB q^K + (1 - pB) 0.97^K)      (without a guide: q = 1),

so the guide lifts log pi(B) by about K log q (+0.8 nats at K = 3, M = 10). Under k3 (and k2) a
position's penalty only sees its own tokens, and the predicted lift is 0: a negative control.

Per seed, the study (1) makes the SFT start: the demo's tiny model fine-tuned on completions drawn
from that distribution; (2) predicts, exactly: the start's own next-token probabilities at every
node of the task's tree (teacher-forced, no sampling) solved by toy.backward for each arm;
(3) trains each arm with sage.py (vLLM rollouts, weight push, loss, guide), its evaluations
probing log pi(B | x) exactly (--eval-solution-format prefix); (4) summarizes predicted and
trained log pi(B), and each guided arm's lift over the unguided arm of its estimator, paired by
seed, with 95% intervals over seeds, against the rule written before the arms ran.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import itertools
import json
import math
import os
import random
import re
import shlex
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import guides
from extras.compare import interval, paired_difference, run
from extras.sft import tokenize_sft_examples
from machinery import cli
from machinery.runs import (
    atomic_output,
    read_jsonl,
    save_model_atomic,
    write_json_atomic,
    write_jsonl_atomic,
)
from task.problems import build_prompt_ids
from toy import backward
from toy.exact import TokenTree

# ---- 1. The task ------------------------------------------------------------------------------

PHRASINGS = (
    "Pick a mode, then write the digits.",
    "Choose A or B and continue.",
    "Write a mode and its digits.",
    "Start with a mode, then the digits.",
)
MODES = ("A", "B")


@dataclass(frozen=True)
class TwoModeTask:
    """The task's distribution: K digits after the mode, M choices after B, pi_ref(B), and the
    probability of each right digit after A."""

    k: int = 3
    m: int = 10
    p_b: float = 0.05
    p_right: float = 0.97

    def __post_init__(self):
        if not (1 <= self.k <= 6 and 2 <= self.m <= 10):
            raise ValueError(
                f"K must be in [1, 6] and M in [2, 10] (digits); got {self.k}, {self.m}"
            )
        if not (0.0 < self.p_b < 1.0 and 0.5 < self.p_right < 1.0):
            raise ValueError("p_b must be in (0, 1) and p_right in (0.5, 1)")

    @property
    def answer(self) -> str:
        """What the reward reads from a problem's answer field: the task's K and M.

        >>> TwoModeTask(k=3, m=8).answer
        'k=3 m=8'
        """
        return f"k={self.k} m={self.m}"

    @classmethod
    def from_answer(cls, answer: str) -> TwoModeTask:
        found = re.fullmatch(r"k=(\d+) m=(\d+)", answer.strip())
        if found is None:
            raise ValueError(f"a two-mode answer field reads 'k=K m=M', got {answer!r}")
        return cls(k=int(found[1]), m=int(found[2]))

    def is_right(self, text: str) -> bool:
        """A then K zeros, or B then K digits below M.

        >>> task = TwoModeTask(k=3, m=4)
        >>> [task.is_right(t) for t in ("A000", "A010", "B312", "B314", "B31", "C000")]
        [True, False, True, False, False, False]
        """
        text = text.strip()
        if len(text) != self.k + 1 or not text[1:].isdigit():
            return False
        if text[0] == "A":
            return set(text[1:]) == {"0"}
        return text[0] == "B" and all(int(digit) < self.m for digit in text[1:])

    def sample(self, rng: random.Random) -> str:
        """One completion drawn from the task's pi_ref (the SFT data)."""
        if rng.random() < self.p_b:
            return "B" + "".join(str(rng.randrange(self.m)) for _ in range(self.k))
        return "A" + "".join("0" if rng.random() < self.p_right else "1" for _ in range(self.k))


def reward(completions, problems, answers) -> list[float]:
    """sage.py's --reward extras.two_mode:reward: 1 for a right completion, else 0."""
    return [float(TwoModeTask.from_answer(a).is_right(c)) for c, a in zip(completions, answers)]


def sft_examples(task: TwoModeTask, count: int, seed: int) -> list[dict]:
    """``count`` SFT examples {problem, completion}: the phrasings in turn, completions drawn from
    the task's distribution."""
    rng = random.Random(seed)
    return [
        {"problem": PHRASINGS[i % len(PHRASINGS)], "completion": task.sample(rng)}
        for i in range(count)
    ]


# ---- 2. The exact prediction from an SFT start ------------------------------------------------


MIN_P = 0.01  # the sampler's threshold, sage.py's --min-p
OTHER, PAD = -1, -2  # the tree's stand-ins for "any token off the task" and what follows it


class TaskTree:
    """The task's completions as a toy.exact.TokenTree over the tokenizer's own ids, with its
    rewards: a mode, K digits and EOS (A's digits 0 or 1, B's below M), and at every node one
    more child, OTHER, that stands for every token off the task. A completion through OTHER is
    wrong (it cannot read as a mode and K digits), so it is one leaf with reward 0, padded to the
    common length with PAD nodes of one child (the per-token estimators' solver wants one
    length). Lumping it is exact under Eq. 4 wherever q = 1 below it, and the guide's q at its
    own node is the node's (a branch q is one number per position)."""

    def __init__(self, task: TwoModeTask, tokenizer):
        def token(text: str) -> int:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ValueError(f"{text!r} is not one token of this tokenizer: {ids}")
            return ids[0]

        self.mode_ids = {mode: token(mode) for mode in MODES}
        digits, eos = [token(str(d)) for d in range(10)], tokenizer.eos_token_id
        length = task.k + 2  # mode, K digits, EOS
        a_paths = [
            (self.mode_ids["A"], *bits, eos)
            for bits in itertools.product(digits[:2], repeat=task.k)
        ]
        b_paths = [
            (self.mode_ids["B"], *chosen, eos)
            for chosen in itertools.product(digits[: task.m], repeat=task.k)
        ]
        self.task_nodes = sorted({y[:t] for y in a_paths + b_paths for t in range(length)})
        other_paths = [s + (OTHER,) + (PAD,) * (length - len(s) - 1) for s in self.task_nodes]
        self.tree = TokenTree(a_paths + b_paths + other_paths)
        right = {a_paths[0]} | set(b_paths)  # A's all-zero path is the first
        self.rewards = torch.tensor(
            [float(y in right) for y in self.tree.completions], dtype=torch.float64
        )
        self.b_param = self.tree.offsets[0] + self.tree.children[0].index(self.mode_ids["B"])
        self.a_param = self.tree.offsets[0] + self.tree.children[0].index(self.mode_ids["A"])

    def log_pi_b(self, theta: torch.Tensor) -> float:
        """log pi(B | x) as the sampler draws it: the root's A and B kept, the tail (OTHER, far
        below min-p's threshold) cut, so pi(B) / (pi(A) + pi(B))."""
        log_probs = self.tree.param_log_probs(theta)
        both = torch.logaddexp(log_probs[self.a_param], log_probs[self.b_param])
        return (log_probs[self.b_param] - both).item()


@torch.no_grad()
def node_distributions(model, prompt_ids: list[int], task_tree: TaskTree, batch_size: int = 512):
    """pi_ref at every node of the tree, teacher-forced at temperature 1 (no sampling): (theta
    [P], the full-vocabulary entropy H of every node [N], and off_task [N, 3]: of the tokens off
    the task that min-p's threshold (MIN_P times the node's most likely token) cuts, their mass
    and their sum of p log p, and how many off-task tokens it keeps). A task node's OTHER child
    gets the mass off its task tokens; a PAD node's one child gets 1 (and H = 0)."""
    tree = task_tree.tree
    device = next(model.parameters()).device
    theta = torch.zeros(tree.num_params, dtype=torch.float64)  # PAD nodes: log 1
    entropies = torch.zeros(len(tree.nodes), dtype=torch.float64)
    off_task = torch.zeros(len(tree.nodes), 3, dtype=torch.float64)
    by_length: dict[int, list[tuple]] = {}
    for node in task_tree.task_nodes:
        by_length.setdefault(len(node), []).append(node)
    for nodes in by_length.values():
        for start in range(0, len(nodes), batch_size):
            chunk = nodes[start : start + batch_size]
            inputs = torch.tensor([prompt_ids + list(node) for node in chunk], device=device)
            log_probs = model(input_ids=inputs).logits[:, -1].double().log_softmax(dim=-1).cpu()
            for row, node in enumerate(chunk):
                i = tree.node_id[node]
                children = tree.children[i]  # OTHER (-1) sorts first
                on_task = log_probs[row, torch.tensor(children[1:])]  # [c - 1]
                other = torch.log1p(-on_task.exp().sum().clamp(max=1.0 - 1e-15))
                theta[tree.offsets[i] : tree.offsets[i] + len(children)] = torch.cat(
                    [other[None], on_task]
                )
                entropies[i] = -(log_probs[row].exp() * log_probs[row]).sum()
                off = torch.ones_like(log_probs[row], dtype=torch.bool)
                off[torch.tensor(children[1:])] = False
                kept = log_probs[row] >= math.log(MIN_P) + log_probs[row].max()
                cut = log_probs[row][off & ~kept]
                off_task[i] = torch.stack(
                    [cut.exp().sum(), (cut.exp() * cut).sum(), (off & kept).sum().double()]
                )
    return theta, entropies, off_task


TOKEN_ALPHA, TOKEN_SIGMA = 0.3, 0.25  # the token arm's guide, held (its schedule's upper bounds)

# The arms: sage.py's flags, and how toy.backward predicts each one's fixed point. Every arm uses
# RLOO's advantage (an unbiased baseline: the toy's node conditions hold with beta as given; GRPO's
# std would rescale the reward against the penalty, docs/estimators.md).
ARMS = {
    "k1_return": {
        "flags": ["--kl-estimator", "k1_return", "--guide", "none"],
        "estimator": "k1_return",
        "guide": None,
    },
    "k1_return_branch_ref": {
        "flags": [
            "--kl-estimator",
            "k1_return",
            "--guide",
            "branch",
            "--guide-entropy",
            "reference",
        ],
        "estimator": "k1_return",
        "guide": "reference",
    },
    "k1_return_branch": {
        "flags": ["--kl-estimator", "k1_return", "--guide", "branch"],
        "estimator": "k1_return",
        "guide": "policy",
    },
    "k3": {"flags": ["--kl-estimator", "k3", "--guide", "none"], "estimator": "k3", "guide": None},
    "k3_branch": {
        "flags": ["--kl-estimator", "k3", "--guide", "branch"],
        "estimator": "k3",
        "guide": "policy",
    },
    # the token guide (Eq. 10) held at its schedule's upper bounds, so that it has a fixed point
    "k1_return_token": {
        "flags": [
            *["--kl-estimator", "k1_return", "--guide", "token", "--guide-cycle-decay", "1"],
            *["--token-alpha", str(TOKEN_ALPHA), str(TOKEN_ALPHA)],
            *["--token-sigma", str(TOKEN_SIGMA), str(TOKEN_SIGMA)],
        ],
        "estimator": "k1_return",
        "guide": "token",
    },
    # the random guide (Eq. 9) on the paper's schedule: q is drawn apart from the token, so its
    # mean log q is one constant at every position, and every completion on the task has K + 2
    "k1_return_random": {
        "flags": ["--kl-estimator", "k1_return", "--guide", "random"],
        "estimator": "k1_return",
        "guide": "random",
    },
    "k2": {"flags": ["--kl-estimator", "k2", "--guide", "none"], "estimator": "k2", "guide": None},
    "k2_branch": {
        "flags": ["--kl-estimator", "k2", "--guide", "branch"],
        "estimator": "k2",
        "guide": "policy",
    },
}
# the arms whose penalty is per token: a position's q cancels from its own choice (predicted lift
# about 0), judged by the equivalence margin
PER_TOKEN = ("k3", "k2")
# each guided arm's lift is paired with the unguided arm of its estimator
UNGUIDED = {
    "k1_return_branch_ref": "k1_return",
    "k1_return_branch": "k1_return",
    "k1_return_token": "k1_return",
    "k1_return_random": "k1_return",
    "k3_branch": "k3",
    "k2_branch": "k2",
}


def sampler_tail(
    task_tree: TaskTree, ref_theta: torch.Tensor, off_task: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the sampler never draws at the trainer's fixed point, and its entropy: (tail [P],
    inside [P]), both on OTHER's parameter at every task node (0 elsewhere). The tail holds
    pi_ref's off-task tokens below min-p's threshold where they are (nothing samples them), and
    each off-task token that min-p keeps at the threshold, MIN_P times the node's most likely
    token: sampled, it is written with reward 0, so pushed down until min-p cuts it. Inside is
    the entropy within the tail, so that the tree's entropy plus pi(OTHER) inside is the full
    vocabulary's."""
    tree = task_tree.tree
    log_probs = tree.param_log_probs(ref_theta)
    tail = torch.zeros(tree.num_params, dtype=torch.float64)
    inside = torch.zeros(tree.num_params, dtype=torch.float64)
    for node in task_tree.task_nodes:
        i = tree.node_id[node]
        other = tree.offsets[i]  # OTHER (-1) sorts first
        cut_mass, cut_p_log_p, kept = off_task[i].tolist()
        at_threshold = MIN_P * log_probs[other + 1 : other + len(tree.children[i])].exp().max()
        mass = cut_mass + kept * at_threshold
        p_log_p = cut_p_log_p + kept * at_threshold * at_threshold.log()
        if mass > 0:
            tail[other] = mass
            inside[other] = mass.log() - p_log_p / mass  # H within: log T - sum (p log p) / T
    return tail, inside


def predict_arms(
    task_tree: TaskTree,
    ref_theta: torch.Tensor,
    ref_entropies: torch.Tensor,
    beta: float,
    arms: tuple[str, ...] = tuple(ARMS),
    off_task: torch.Tensor | None = None,
) -> dict[str, float]:
    """log pi(B) at each arm's fixed point, and at pi_ref ("start"), from pi_ref's tree logits
    [P] and its full-vocabulary entropies [N].

    q held at pi_ref's entropies (Eq. 11 on the entropies the trainer reads):
    ``backward.fixed_point`` with that q; q from the policy's own entropies:
    ``backward.self_consistent_fixed_point`` (the tree's entropies, OTHER as one token). OTHER is
    a reward-0 child there, which the fixed point all but empties. The token guide's q is one
    number per completion, read from the policy's own surprisals (``token_fixed_point``); the
    random guide's is drawn apart from the tokens, so its mean adds the same constant to every
    return on the task (K + 2 tokens each) and its fixed point is the unguided arm's.

    With ``off_task`` [N, 3] (``node_distributions``'), each k1_return arm is also predicted
    as the trainer reaches it ("<arm>/sampler"): min-p never samples the tail, so nothing pushes
    it down; the fixed point holds it (``sampler_tail``) and solves Eq. 4 on the sampler's
    support (``backward.sampler_fixed_point``), and the policy's q reads the full vocabulary's
    entropy, the tail's included.
    """
    tree, rewards, branch = task_tree.tree, task_tree.rewards, guides.GuideConfig(name="branch")
    predicted = {"start": task_tree.log_pi_b(ref_theta)}
    node_q = guides.branch_guide(ref_entropies, tau=branch.tau, ratio=branch.ratio).double()
    ref_log_q = node_q.clamp(branch.q_min, branch.q_max).log()[tree.node_of_param]  # [P]
    tail = inside = None
    if off_task is not None:
        tail, inside = sampler_tail(task_tree, ref_theta, off_task)
    for arm in arms:
        spec = ARMS[arm]
        if spec["guide"] == "policy":
            theta, _ = backward.self_consistent_fixed_point(
                tree, ref_theta, rewards, estimator=spec["estimator"], beta=beta, config=branch
            )
        elif spec["guide"] == "token":
            theta, _ = token_fixed_point(task_tree, ref_theta, beta=beta)
        else:  # none, reference, or random: its mean log q adds one constant to every return
            log_q = torch.zeros(tree.num_params, dtype=torch.float64)
            if spec["guide"] == "reference":
                log_q = ref_log_q
            theta = backward.fixed_point(
                tree, ref_theta, rewards, log_q, estimator=spec["estimator"], beta=beta
            )
        predicted[arm] = task_tree.log_pi_b(theta)
        if tail is None or spec["estimator"] != "k1_return":
            continue
        if spec["guide"] == "policy":
            theta, _ = backward.self_consistent_fixed_point(
                tree,
                ref_theta,
                rewards,
                estimator="k1_return",
                beta=beta,
                config=branch,
                tail=tail,
                min_p=MIN_P,
                inside=inside,
            )
        elif spec["guide"] == "token":
            theta, _ = token_fixed_point(task_tree, ref_theta, beta=beta, tail=tail)
        else:
            theta, _ = backward.sampler_fixed_point(
                tree, ref_theta, rewards, log_q, beta=beta, tail=tail, min_p=MIN_P
            )
        predicted[f"{arm}/sampler"] = task_tree.log_pi_b(theta)
    return predicted


def token_fixed_point(
    task_tree: TaskTree, ref_theta: torch.Tensor, beta: float, tail: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token arm's fixed point (``backward.token_guide_fixed_point``, alpha and sigma held at
    TOKEN_ALPHA and TOKEN_SIGMA): w_t normalized over the tokens the trainer sees, a PAD node
    (the tree's filler after OTHER) not among them. Returns (theta [P], log q(y) [B])."""
    tree = task_tree.tree
    pads = torch.tensor([[token == PAD for token in y] for y in tree.completions])  # one length
    return backward.token_guide_fixed_point(
        tree,
        ref_theta,
        task_tree.rewards,
        beta=beta,
        config=guides.GuideConfig(name="token"),
        alpha=TOKEN_ALPHA,
        sigma=TOKEN_SIGMA,
        token_mask=tree.completion_mask.masked_fill(pads, 0.0),
        tail=tail,
        min_p=MIN_P,
    )


def token_lift_at_trained_tail(
    seed_dir: str, task: TwoModeTask, beta: float, arm: str = "k1_return_token"
) -> list[float]:
    """Post hoc, per phrasing: the token arm's lift over k1_return as ``predict_arms``' sampler
    model gives it, but with the tail below min-p held where ``arm``'s trained policy (its
    checkpoint's adapter) has it instead of at pi_ref's. The token guide normalizes surprisal
    within a completion, so on A's nearly certain completions the small mass the sampler never
    draws decides which token counts as surprising, and training grows that mass."""
    from peft import PeftModel

    start = os.path.join(seed_dir, "sft_model")
    tokenizer = AutoTokenizer.from_pretrained(start)
    task_tree = TaskTree(task, tokenizer)
    tree, no_q = task_tree.tree, torch.zeros(task_tree.tree.num_params, dtype=torch.float64)
    base = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    adapter = os.path.join(seed_dir, arm, "checkpoint", "model")
    trained = PeftModel.from_pretrained(base, adapter).eval()
    nodes = np.load(os.path.join(seed_dir, "start_nodes.npz"))
    lifts = []
    for i, phrasing in enumerate(PHRASINGS):
        prompt_ids = build_prompt_ids(tokenizer, phrasing)
        theta, _, off_task = node_distributions(trained, prompt_ids, task_tree)
        tail, _ = sampler_tail(task_tree, theta, off_task)  # the trained policy's
        ref_theta = torch.from_numpy(nodes["theta"][i])
        plain, _ = backward.sampler_fixed_point(
            tree, ref_theta, task_tree.rewards, no_q, beta=beta, tail=tail, min_p=MIN_P
        )
        guided, _ = token_fixed_point(task_tree, ref_theta, beta=beta, tail=tail)
        lifts.append(task_tree.log_pi_b(guided) - task_tree.log_pi_b(plain))
    return lifts


def weights_sha256(model_dir: str) -> str:
    """One SHA-256 over the start's weight files (*.safetensors, in name order): the start a
    prediction was made from, so that a reader knows whether theirs is the same."""
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with open(path, "rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()


def predict_start(
    model_dir: str,
    task: TwoModeTask,
    beta: float,
    arms: tuple[str, ...] = tuple(ARMS),
    nodes_path: str | None = None,
) -> dict:
    """The prediction of every arm from one SFT start, averaged over the phrasings (log pi(B) is
    averaged as the probe averages it), with the largest probability, over the phrasings, that
    pi_ref writes a completion off the task (through OTHER), and the largest gap between the
    full-vocabulary entropy (what the trainer's guide reads) and the tree's (OTHER lumped) at B's
    positions. ``start_sha256`` names the start's weights. With ``nodes_path``, the start's
    node probabilities are written there (numpy's .npz, per phrasing: ``theta`` [P], the tree's
    log-probabilities in ``TaskTree(task, tokenizer).tree``'s order, ``entropies`` [N] and
    ``off_task`` [N, 3], as ``node_distributions`` returns them), and their SHA-256 goes in
    ``nodes_sha256``: from them ``predict_arms`` re-makes every number without the start."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    task_tree = TaskTree(task, tokenizer)
    tree = task_tree.tree
    through_other = [i for i, y in enumerate(tree.completions) if OTHER in y]
    b_mode = (task_tree.mode_ids["B"],)
    b_nodes = [tree.node_id[s] for s in task_tree.task_nodes if s[:1] == b_mode]
    per_phrasing, off_task, entropy_gap = [], 0.0, 0.0
    nodes = {"theta": [], "entropies": [], "off_task": []}
    for phrasing in PHRASINGS:
        theta, entropies, node_tails = node_distributions(
            model, build_prompt_ids(tokenizer, phrasing), task_tree
        )
        for name, values in zip(nodes, (theta, entropies, node_tails)):
            nodes[name].append(values.numpy())
        per_phrasing.append(
            predict_arms(
                task_tree,
                theta,
                ref_entropies=entropies,
                beta=beta,
                arms=arms,
                off_task=node_tails,
            )
        )
        # the probability that pi_ref writes a completion through OTHER
        off_task = max(off_task, tree.sequence_logps(theta)[through_other].exp().sum().item())
        gap = (entropies - tree.node_entropies(theta))[b_nodes].abs().max().item()
        entropy_gap = max(entropy_gap, gap)
    names = per_phrasing[0]
    prediction = {
        "log_pi_b": {
            name: sum(p[name] for p in per_phrasing) / len(per_phrasing) for name in names
        },
        "per_phrasing": per_phrasing,
        "max_off_task_probability": off_task,
        "max_entropy_gap_at_b": entropy_gap,
        "start_sha256": weights_sha256(model_dir),
    }
    if nodes_path is not None:
        with atomic_output(nodes_path, mode="wb") as handle:
            np.savez_compressed(handle, **{name: np.stack(v) for name, v in nodes.items()})
        with open(nodes_path, "rb") as handle:
            prediction["nodes_sha256"] = hashlib.file_digest(handle, "sha256").hexdigest()
    return prediction


# ---- 3. The stages of one seed: its SFT start, its prediction, each arm's training ------------


def train_flags(args, prompt_len: int) -> list[str]:
    """sage.py's flags shared by every arm: the demo's laptop-sized step on the two-mode task,
    with an exact probe of log pi(B | x) at every evaluation."""
    budget = args.k + 2 + 2  # the mode, K digits and EOS, and room for a longer mistake
    return [
        *["--steps", str(args.steps), "--prompts-per-step", "8", "--rollouts", "8"],
        *["--micro-batch-size", "64", "--no-gradient-checkpointing"],
        *["--lr", str(args.lr), "--warmup-ratio", "0.05"],
        *["--lora-rank", "16", "--lora-alpha", "32"],
        *["--max-prompt-len", str(prompt_len), "--max-seq-len", str(prompt_len + budget)],
        *["--advantage", "rloo", "--beta", str(args.beta)],
        *["--reward", "extras.two_mode:reward", "--problem-key", "problem"],
        *["--answer-key", "answer", "--gpu-memory-utilization", "0.2", "--save-every", "100000"],
        *["--eval-every", str(args.eval_every), "--eval-n", "1", "--eval-temperature", "1.0"],
        *["--eval-top-p", "1.0", "--eval-solution-key", "mode", "--eval-solution-format", "prefix"],
    ]


def make_start(seed_dir: str, seed: int, args) -> dict[str, str]:
    """The seed's SFT start (the demo's tiny model, its own init, fine-tuned on completions drawn
    from the task) and the task's files; kept if made already."""
    import sage
    from extras import demo, sft

    task = TwoModeTask(k=args.k, m=args.m)
    # the phrasings, each with the task in its answer field and B as the probe's prefix: both
    # the training problems and the benchmark the evaluations probe
    files = {
        "model": os.path.join(seed_dir, "sft_model"),
        "problems": os.path.join(seed_dir, "problems.jsonl"),
    }
    made_with = {
        "k": args.k,
        "m": args.m,
        "sft_examples": args.sft_examples,
        "sft_epochs": args.sft_epochs,
    }
    recipe = os.path.join(seed_dir, "start.json")  # what the start was made with
    made = os.path.exists(os.path.join(files["model"], "config.json"))
    recorded = None
    if made and os.path.exists(recipe):
        with open(recipe) as handle:
            recorded = json.load(handle)
    if made and recorded != made_with:
        raise SystemExit(
            f"error: {seed_dir}'s start was made with other settings, or before {recipe} "
            "recorded them: pass another --out, or remove that directory"
        )
    rows = [{"problem": p, "answer": task.answer, "mode": "B"} for p in PHRASINGS]
    write_jsonl_atomic(files["problems"], rows)
    if made:
        return files
    torch.manual_seed(seed)
    init_dir = demo.save_tiny_model(os.path.join(seed_dir, "init_model"), seed=seed)
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    examples = sft_examples(task, count=args.sft_examples, seed=seed + 1)
    pairs, _ = tokenize_sft_examples(tokenizer, examples, max_tokens=1024)
    settings = sft.SFTConfig(sft_epochs=args.sft_epochs, sft_lr=2e-3, sft_batch_size=16)
    sft.sft(model, pairs, tokenizer.pad_token_id, settings, sage.Config(seed=seed), progress=False)
    write_json_atomic(recipe, made_with)  # first: a saved start always has its recipe
    save_model_atomic(model, tokenizer, files["model"])
    shutil.rmtree(init_dir, ignore_errors=True)
    return files


def prompt_length(model_dir: str) -> int:
    """The longest phrasing's prompt in tokens (the chat template and system prompt included)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return max(len(build_prompt_ids(tokenizer, p)) for p in PHRASINGS)


def train_arm(seed_dir: str, seed: int, arm: str, files: dict, flags: list[str], args) -> str:
    """Train one arm from the seed's start with the shared ``flags`` (``train_flags``) and its own
    (a finished arm is kept; a killed one starts again)."""
    run_dir = os.path.join(seed_dir, arm)
    if os.path.exists(os.path.join(run_dir, "done")):
        return run_dir
    if os.path.exists(run_dir):
        shutil.rmtree(run_dir)
    command = [
        *["sage.py", "--model", files["model"], "--dataset", files["problems"]],
        *["--eval-benchmarks", files["problems"], "--out", seed_dir, "--name", arm],
        *["--seed", str(seed), *flags],
        *shlex.split(args.flags),
        *ARMS[arm]["flags"],
    ]
    run(command, threads=args.threads)
    with open(os.path.join(run_dir, "done"), "w") as handle:
        handle.write("trained\n")
    return run_dir


def trajectory(run_dir: str) -> list[dict]:
    """[{step, log_pi_b, log_pi_b_full, outside}] from the run's evaluations: the probe's mean over
    the phrasings of log pi(B | x) under the sampler's distribution (min-p; over the phrasings
    where B is kept) and pi_T's full softmax, and the share of phrasings where min-p cuts B."""
    points = []
    for row in read_jsonl(os.path.join(run_dir, "eval.jsonl")):
        entry = row["support"]["all"]
        points.append(
            {
                "step": row["step"],
                "log_pi_b": entry["mean_logp"],
                "log_pi_b_full": entry["mean_logp_full"],
                "outside": entry["outside"],
            }
        )
    return points


STEP_KEYS = (
    "reward",
    "grad_norm",
    "kl/ref_k3",
    "kl/anchor_k3",
    "kl/anchor_offset",
    "q/mean",
    "q/min",
    "q/max",
    "q/frac_active",
    "entropy",
)


def step_metrics(run_dir: str) -> dict[str, list]:
    """The run's per-step metrics.jsonl as columns ({"step": [...], "grad_norm": [...], ...}, the
    keys of STEP_KEYS it logs), each value to 6 significant digits: what the study commits so
    that a spike or a drift of the gradient norm, the KL terms or q can be re-checked."""
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    keys = ["step", *(key for key in STEP_KEYS if rows and key in rows[0])]
    return {key: [float(f"{row[key]:.6g}") for row in rows] for key in keys}


def prepare_seed(seed: int, args) -> dict:
    """One seed's start and its prediction (each kept if made already): {prediction, seed_dir,
    files}, what its arms train from."""
    seed_dir = os.path.join(args.out, f"seed-{seed}")
    os.makedirs(seed_dir, exist_ok=True)
    files = make_start(seed_dir, seed, args)
    prediction_file = os.path.join(seed_dir, "prediction.json")
    known, settings = {}, {"k": args.k, "m": args.m, "beta": args.beta}
    if os.path.exists(prediction_file):
        with open(prediction_file) as handle:
            made = json.load(handle)
        known = made["log_pi_b"] if made.get("settings") == settings else {}
    if not all(arm in known for arm in args.arms):  # for fewer arms, other settings, or not yet
        task = TwoModeTask(k=args.k, m=args.m)
        prediction = predict_start(
            files["model"],
            task,
            beta=args.beta,
            arms=tuple(args.arms),
            nodes_path=os.path.join(seed_dir, "start_nodes.npz"),
        )
        prediction["settings"] = settings
        write_json_atomic(prediction_file, prediction)
    with open(prediction_file) as handle:
        prediction = json.load(handle)
    return {"prediction": prediction, "seed_dir": seed_dir, "files": files}


def train_arms(prepared: dict[int, dict], args) -> dict[int, dict]:
    """Every arm of every seed, --jobs at a time from one queue (so that no core waits for a
    seed's last arm): per seed, {prediction, arms: trajectories, steps: per-step metrics}."""

    flags = {
        seed: train_flags(args, prompt_len=prompt_length(seed_files["files"]["model"]))
        for seed, seed_files in prepared.items()
    }

    def train(seed_and_arm: tuple[int, str]) -> str:
        seed, arm = seed_and_arm
        seed_dir, files = prepared[seed]["seed_dir"], prepared[seed]["files"]
        return train_arm(seed_dir, seed, arm, files=files, flags=flags[seed], args=args)

    queue = [(seed, arm) for seed in prepared for arm in args.arms]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        run_dirs = dict(zip(queue, pool.map(train, queue)))
    return {
        seed: {
            "prediction": prepared[seed]["prediction"],
            "arms": {arm: trajectory(run_dirs[seed, arm]) for arm in args.arms},
            "steps": {arm: step_metrics(run_dirs[seed, arm]) for arm in args.arms},
        }
        for seed in prepared
    }


# ---- 4. The summary: predicted and trained log pi(B), lifts paired by seed, the rule ----------

RULE = (
    "A guided k1_return arm reproduces Theorem 4.3 when the 95% interval over seeds of its lift "
    "in the final log pi(B) over the k1_return arm without a guide (paired by seed) excludes 0 "
    "and contains the mean predicted lift. The k3 control holds when the interval of k3_branch's "
    "lift over k3 contains 0."
)


def summarize(per_seed: dict[int, dict], args, seconds: float) -> dict:
    """Per arm and seed: predicted, trained (the last evaluation) and start log pi(B); per arm,
    intervals over seeds of each, of trained minus predicted, and of the lift over the unguided
    arm of its estimator, predicted and trained; the verdict of ``RULE``.

    The trained measure is the sampler's: where min-p cuts B at the last evaluation (pi(B) below
    1% of pi(A) for some phrasing), the sampler never writes B and its log pi(B) is -inf; that
    seed's value is None and the arm has no interval ("outside_seeds" names the seeds). The same
    measures over pi_T's full softmax ("trained_full", "lift_trained_full") are always finite.
    """
    arms = [arm for arm in args.arms if all(arm in s["arms"] for s in per_seed.values())]
    table = {}
    for arm in arms:
        seeds = {}
        for seed, result in per_seed.items():
            last = result["arms"][arm][-1]
            predicted = result["prediction"]["log_pi_b"][arm]
            trained = None if last["outside"] > 0 else last["log_pi_b"]
            seeds[seed] = {
                "start": result["prediction"]["log_pi_b"]["start"],
                "predicted": predicted,
                "trained": trained,
                "trained_full": last["log_pi_b_full"],
                "trained_minus_predicted": None if trained is None else trained - predicted,
            }
        outside = [seed for seed, values in seeds.items() if values["trained"] is None]
        table[arm] = {"per_seed": seeds, "outside_seeds": outside}
        for measure in ("start", "predicted", "trained", "trained_full", "trained_minus_predicted"):
            values = [values[measure] for values in seeds.values()]
            table[arm][measure] = interval([] if None in values else values)
    for arm, unguided in UNGUIDED.items():
        if arm in table and unguided in table:
            guided_seeds, plain_seeds = table[arm]["per_seed"], table[unguided]["per_seed"]
            lifts = {"lift_predicted": "predicted", "lift_trained_full": "trained_full"}
            for key, measure in lifts.items():
                table[arm][key] = paired_difference(guided_seeds, plain_seeds, measure)
            either_outside = table[arm]["outside_seeds"] or table[unguided]["outside_seeds"]
            table[arm]["lift_trained"] = (
                interval([])
                if either_outside
                else paired_difference(guided_seeds, plain_seeds, "trained")
            )
    return {
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"}},
        "rule": RULE,
        "arms": table,
        "verdict": verdict(table),
        "margin_rule": {"margins": MARGINS, "plateau_nats": PLATEAU_NATS},
        "margin_verdict": margin_verdict(per_seed, arms, steps=args.steps),
        "trajectories": {
            arm: {seed: result["arms"][arm] for seed, result in per_seed.items()} for arm in arms
        },
        "wall_seconds": {"this_invocation": seconds, "arms": arms_wall_seconds(args.out)},
    }


def arms_wall_seconds(out: str) -> float | None:
    """From the first arm's start (its config.json) to the last arm's end (its ``done``), read
    off the files, so a study continued after a stop still reports when its arms ran."""
    arms = [os.path.join(out, "seed-*", arm) for arm in ARMS]  # (sft_model has a config.json)
    starts = [os.path.getmtime(p) for arm in arms for p in glob.glob(f"{arm}/config.json")]
    ends = [os.path.getmtime(p) for arm in arms for p in glob.glob(f"{arm}/done")]
    return max(ends) - min(starts) if starts and ends else None


def verdict(table: dict) -> dict[str, str]:
    """``RULE`` applied to each guided arm: reproduced / not reproduced / too few seeds."""
    found = {}
    for arm, unguided in UNGUIDED.items():
        if arm not in table:
            continue
        outside = sorted(set(table[arm]["outside_seeds"]) | set(table[unguided]["outside_seeds"]))
        if outside:
            found[arm] = (
                f"not reproduced: B left the sampler's support (min-p) on seed(s) "
                f"{', '.join(map(str, outside))}, so its log pi(B) there is -inf"
            )
            continue
        lift = table[arm]["lift_trained"]
        if lift["low"] is None:
            found[arm] = "too few seeds"
            continue
        predicted = table[arm]["lift_predicted"]["mean"]
        contains_prediction = lift["low"] <= predicted <= lift["high"]
        excludes_zero = lift["low"] > 0 or lift["high"] < 0
        if UNGUIDED[arm] in PER_TOKEN:
            holds = lift["low"] <= 0 <= lift["high"]
            found[arm] = "control holds (contains 0)" if holds else "control fails (excludes 0)"
        elif excludes_zero and contains_prediction:
            found[arm] = "reproduced"
        else:
            found[arm] = (
                f"not reproduced (excludes 0: {excludes_zero}, contains the prediction "
                f"{predicted:+.2f}: {contains_prediction})"
            )
    return found


# The margin rule (docs/two-mode-preregistration.md), fixed before the arms it judges ran. Each
# margin is chosen by power for 3 seeds, from the per-seed spreads of the earlier study: if
# every prediction is exact, all 24 comparisons of three settings pass together with
# probability 0.8 (each at 0.991: the mean's error below 2.60 standard errors).
MARGINS = {"lift": 0.20, "k3_lift": 0.08, "level": 0.54}  # "k3_lift": every PER_TOKEN lift
PLATEAU_NATS = 0.05  # log pi(B), and the reward's block means, over the last 20% of the steps


def lift_margin(unguided: str) -> float:
    """The margin of a lift over ``unguided``: the equivalence margin for a per-token penalty."""
    return MARGINS["k3_lift" if unguided in PER_TOKEN else "lift"]


def logit(log_p: float) -> float:
    """log p - log (1 - p): a level in log-odds (the sampler's root keeps A and B only).

    >>> round(logit(math.log(0.25)), 4)  # log(1 / 3)
    -1.0986
    """
    return log_p - math.log1p(-math.exp(log_p))


def plateaued(points: list[dict], rewards: list[float], steps: int) -> bool:
    """The plateau test: over the last 20% of the steps, log pi(B) at the evaluations, and the
    means of the reward over five equal blocks (each reward its own block where there are fewer
    than five), each move less than PLATEAU_NATS (largest minus smallest).

    >>> points = [{"step": 16, "log_pi_b": -2.0}, {"step": 20, "log_pi_b": -2.01}]
    >>> plateaued(points, rewards=[1.0] * 20, steps=20)  # a tail of 4 rewards, all 1
    True
    """
    late = [point["log_pi_b"] for point in points if point["step"] >= 0.8 * steps]
    tail = rewards[int(0.8 * steps) :]
    size = max(1, len(tail) // 5)
    blocks = [sum(tail[i : i + size]) / size for i in range(0, min(size * 5, len(tail)), size)]
    return (
        len(late) >= 2
        and max(late) - min(late) < PLATEAU_NATS
        and max(blocks) - min(blocks) < PLATEAU_NATS
    )


def margin_verdict(per_seed: dict[int, dict], arms: list[str], steps: int) -> dict:
    """The margin rule per arm: its level (the last evaluation's log pi(B) minus the prediction
    of the trainer's fixed point, ``<arm>/sampler`` where there is one) where every seed passed
    the plateau test, and each guided arm's lift over its unguided arm (paired by seed) minus the
    predicted lift; pass when the mean over seeds is within its margin. Levels and lifts also in
    log-odds (reported, not judged)."""
    rows = {}
    for arm in arms:
        seeds = {}
        for seed, result in per_seed.items():
            prediction, last = result["prediction"]["log_pi_b"], result["arms"][arm][-1]
            predicted = prediction.get(f"{arm}/sampler", prediction[arm])
            trained = None if last["outside"] > 0 else last["log_pi_b"]
            rewards = result["steps"][arm]["reward"]
            seeds[seed] = {
                "predicted": predicted,
                "trained": trained,
                "predicted_logodds": logit(predicted),
                "trained_logodds": None if trained is None else logit(trained),
                "plateaued": plateaued(result["arms"][arm], rewards, steps),
            }
        rows[arm] = {"per_seed": seeds}
    for arm, row in rows.items():
        seeds = row["per_seed"].values()
        if any(s["trained"] is None for s in seeds):
            row["level"] = "fails: B left the sampler's support on a seed"
        elif not all(s["plateaued"] for s in seeds):
            row["level"] = "transient: not every seed passed the plateau test (not judged)"
        else:
            error = sum(s["trained"] - s["predicted"] for s in seeds) / len(seeds)
            row["level_error"] = error
            passes = abs(error) < MARGINS["level"]
            row["level"] = f"{'passes' if passes else 'fails'} ({error:+.3f} nats)"
        unguided = UNGUIDED.get(arm)
        if unguided not in rows:
            continue
        pairs = [(row["per_seed"][seed], rows[unguided]["per_seed"][seed]) for seed in per_seed]
        if any(g["trained"] is None or u["trained"] is None for g, u in pairs):
            row["lift"] = "fails: B left the sampler's support on a seed"
            continue
        for scale in ("", "_logodds"):
            lifts = [
                (g[f"trained{scale}"] - u[f"trained{scale}"])
                - (g[f"predicted{scale}"] - u[f"predicted{scale}"])
                for g, u in pairs
            ]
            row[f"lift_error{scale}"] = sum(lifts) / len(lifts)
        passes = abs(row["lift_error"]) < lift_margin(unguided)
        row["lift"] = f"{'passes' if passes else 'fails'} ({row['lift_error']:+.3f} nats)"
    return rows


def judge_at(summary: dict, steps: dict, at_step: int) -> dict:
    """The margin rule on a finished study's first ``at_step`` steps, from its summary.json and
    steps.json.gz alone (no training): each arm's last evaluation at or before that step against
    the prediction the study judged, and the plateau test over that step's last 20%. What a
    shorter study would have decided, but not a shorter run: the learning rate decays to 0 over
    the run's own --steps, so step N of a longer run still trains at a higher rate."""
    rows = summary["margin_verdict"]
    per_seed = {}
    for seed in next(iter(summary["trajectories"].values())):
        per_seed[seed] = {
            "prediction": {"log_pi_b": {a: rows[a]["per_seed"][seed]["predicted"] for a in rows}},
            "arms": {
                arm: [point for point in points[seed] if point["step"] <= at_step]
                for arm, points in summary["trajectories"].items()
            },
            "steps": {arm: {"reward": steps[arm][seed]["reward"][:at_step]} for arm in rows},
        }
    return margin_verdict(per_seed, list(rows), steps=at_step)


def format_report(summary: dict) -> str:
    """The table: per arm, start, predicted and trained log pi(B), trained - predicted, and the
    lift over the unguided arm (predicted; trained), means with 95% intervals over seeds."""

    def cell(value: dict | None) -> str:
        if not value or value["mean"] is None:
            return "-"
        if value["low"] is None:
            return f"{value['mean']:+.3f}"
        return f"{value['mean']:+.3f} [{value['low']:+.2f}, {value['high']:+.2f}]"

    columns = ("predicted", "trained", "trained_full", "lift_predicted", "lift_trained")
    columns += ("lift_trained_full",)
    lines = [f"{'arm':22}" + "".join(f"{c:>28}" for c in columns)]
    for arm, entry in summary["arms"].items():
        lines.append(f"{arm:22}" + "".join(f"{cell(entry.get(c)):>28}" for c in columns))
    lines += [f"{arm}: {text}" for arm, text in summary["verdict"].items()]
    for arm, row in summary["margin_verdict"].items():
        lift = f", lift {row['lift']}" if "lift" in row else ""
        lines.append(f"margins, {arm}: level {row['level']}{lift}")
    return "\n".join(lines)


def format_tiny(summary: dict) -> str:
    """The demo's report: each arm's log pi(B) at the start, predicted (the fixed point as the
    trainer reaches it, as the margin rule reads it) and trained (the last probe); then the
    guide's lift, predicted and trained, and whether they agree within the study's margin."""
    settings, rows = summary["settings"], summary["margin_verdict"]
    lines = [
        f"two-mode task, K = {settings['k']}, M = {settings['m']}, seed {settings['first_seed']}, "
        f"{settings['steps']} steps per arm: log pi(B) (pi(B))",
        f"{'arm':20}{'start':>16}{'predicted':>16}{'trained':>16}",
    ]

    def cell(log_p: float | None) -> str:
        return "outside min-p" if log_p is None else f"{log_p:+.2f} ({math.exp(log_p):.1%})"

    for arm, row in rows.items():
        (values,) = row["per_seed"].values()
        (start,) = (seed["start"] for seed in summary["arms"][arm]["per_seed"].values())
        lines.append(
            f"{arm:20}{cell(start):>16}{cell(values['predicted']):>16}{cell(values['trained']):>16}"
        )
    theory = {
        "k1_return": "With k1 in the return the fixed point is Eq. 4's",
        "k3": "Under k3, the paper's estimator, q cancels from each position's own choice",
        "k2": "Under k2, too, q cancels from each position's own choice",
    }
    for arm, unguided in UNGUIDED.items():
        if arm not in rows or unguided not in rows:
            continue
        (guided,), (plain,) = rows[arm]["per_seed"].values(), rows[unguided]["per_seed"].values()
        predicted = guided["predicted"] - plain["predicted"]
        if guided["trained"] is None or plain["trained"] is None:
            lines.append(f"{arm}: B fell below min-p's threshold in an arm; no lift to compare")
            continue
        trained = guided["trained"] - plain["trained"]
        verdict = "agrees" if rows[arm]["lift"].startswith("passes") else "does not agree"
        lines.append(
            f"{theory[unguided]}: the branch guide's lift over {unguided} is {predicted:+.2f} "
            f"nats predicted, {trained:+.2f} trained; the run {verdict} within the study's "
            f"margin ({lift_margin(unguided):.2f} nats)."
        )
    return "\n".join(lines)


def plot_arms(summary: dict, out: str) -> None:
    """One seed's arms in one panel: pi(B | x) against the step (the full softmax's, finite where
    min-p cuts B), each arm's predicted fixed point dashed in its colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(5.6, 3.6))
    for colour, (arm, row) in enumerate(summary["margin_verdict"].items()):
        ((seed, values),) = row["per_seed"].items()
        points = summary["trajectories"][arm][seed]
        steps = [point["step"] for point in points]
        values_b = [math.exp(point["log_pi_b_full"]) for point in points]
        label = " ".join(ARMS[arm]["flags"])  # the arm as sage.py's flags
        axis.plot(steps, values_b, color=f"C{colour}", linewidth=1.4, label=label)
        axis.axhline(math.exp(values["predicted"]), color=f"C{colour}", linestyle="--")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("pi(B | x)  (dashed: predicted)")
    axis.legend(fontsize=8)
    settings = summary["settings"]
    axis.set_title(
        f"two-mode task, K = {settings['k']}, M = {settings['m']}: pi(B) per arm",
        fontsize=10,
    )
    save_figure(fig, out)


def save_figure(fig, out: str) -> None:
    """Write ``fig`` to ``out`` atomically (a killed run leaves no half-written PNG)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    temporary = out + ".tmp.png"
    fig.savefig(temporary, dpi=110)
    plt.close(fig)
    os.replace(temporary, out)


def plot(summary: dict, out: str) -> None:
    """One panel per arm: pi(B | x) against the step for each seed (the exp of the mean over
    phrasings of log pi_T(B | x), the full softmax's, finite where min-p cuts B) and, dashed in
    the seed's colour, that seed's predicted fixed point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary["trajectories"])
    fig, axes = plt.subplots(1, len(arms), figsize=(3.2 * len(arms), 3.6), sharey=True)
    for axis, arm in zip(axes, arms):
        for colour, (seed, points) in enumerate(summary["trajectories"][arm].items()):
            steps = [point["step"] for point in points]
            values = [math.exp(point["log_pi_b_full"]) for point in points]
            axis.plot(steps, values, color=f"C{colour}", linewidth=1.2, label=f"seed {seed}")
            predicted = summary["arms"][arm]["per_seed"][seed]["predicted"]
            axis.axhline(math.exp(predicted), color=f"C{colour}", linestyle="--", linewidth=0.8)
        axis.set_title(arm, fontsize=9)
        axis.set_xlabel("optimizer step", fontsize=8)
    axes[0].set_ylabel("pi(B | x) (dashed: the exact prediction)", fontsize=8)
    axes[0].legend(fontsize=7)
    seconds = summary["wall_seconds"]["arms"] or summary["wall_seconds"]["this_invocation"]
    fig.suptitle(
        f"two-mode task, K = {summary['settings']['k']}, M = {summary['settings']['m']}: "
        f"the trained pi(B) per seed against its prediction (arms trained in "
        f"{seconds / 60:.0f} min)",
        fontsize=10,
    )
    save_figure(fig, out)


# ---- 5. The command line ----------------------------------------------------------------------


# The tiny version, `make demo`: the study's beta and task of K = 3, M = 8 (the arms plateau within
# about 60 steps there), a smaller SFT start, and one seed that no study uses.
TINY = {
    "out": "runs/two-mode-demo",
    "seeds": 1,
    "first_seed": 8,
    "steps": 100,
    "eval_every": 10,
    "beta": 0.5,
    "k": 3,
    "m": 8,
    "sft_examples": 1200,
    "arms": "k1_return,k1_return_branch,k3,k3_branch",
    "jobs": 2,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m extras.two_mode", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", default="runs/two-mode", help="the study's directory")
    parser.add_argument("--seeds", type=int, default=4, help="training seeds")
    parser.add_argument("--first-seed", type=int, default=1000, help="the first seed")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per arm")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between probes")
    parser.add_argument("--beta", type=float, default=0.05, help="the KL coefficient")
    parser.add_argument("--lr", type=float, default=1e-3, help="the learning rate of every arm")
    parser.add_argument("--k", type=int, default=3, help="digits after the mode")
    parser.add_argument("--m", type=int, default=10, help="choices per digit after B")
    parser.add_argument("--sft-examples", type=int, default=2400, help="SFT examples per start")
    parser.add_argument("--sft-epochs", type=int, default=2, help="SFT epochs per start")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms")
    parser.add_argument("--flags", default="", help="sage.py flags added to every arm")
    parser.add_argument("--jobs", type=int, default=2, help="arms trained at once")
    parser.add_argument("--threads", type=int, default=0, help="cores per job (0: split)")
    parser.add_argument(
        "--predict-only", action="store_true", help="make the starts and their predictions only"
    )
    parser.add_argument(
        "--judge-at",
        type=int,
        default=0,
        metavar="STEP",
        help="judge the finished study in --out by the margin rule on its first STEP steps (reads "
        "summary.json and steps.json.gz; trains nothing)",
    )
    parser.add_argument(
        "--token-tail-check",
        action="store_true",
        help="after a study with k1_return_token: its lift predicted again with the tail below "
        "min-p held at the trained policy's (token_lift_at_trained_tail), per seed, into "
        "token-tail-check.json",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help=(
            "make demo: one seed, 100 steps of k1_return and of k3, each with and without the "
            "branch guide, a short table and the figure, in runs/two-mode-demo (2 minutes)"
        ),
    )
    if parser.parse_known_args(argv)[0].tiny:  # smaller defaults; flags given still win
        parser.set_defaults(**TINY)
    args = parser.parse_args(argv)
    args.arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = [arm for arm in args.arms if arm not in ARMS]
    if unknown:
        parser.error(f"unknown --arms {', '.join(unknown)}: choose among {', '.join(ARMS)}")
    for name in ("seeds", "steps", "eval_every", "jobs", "k", "m", "sft_examples", "sft_epochs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (args.beta > 0 and args.lr > 0):
        parser.error("--beta and --lr must be > 0")
    try:
        TwoModeTask(k=args.k, m=args.m)  # K and M in range
    except ValueError as problem:
        parser.error(f"--k {args.k} --m {args.m}: {problem}")
    if args.judge_at < 0:
        parser.error(f"--judge-at {args.judge_at}: pass a step >= 1 of the finished study")
    if args.judge_at and args.token_tail_check:
        parser.error("--judge-at and --token-tail-check are two readings of a study: pass one")
    if problem := cli.unwritable("--out", args.out):
        parser.error(problem)
    missing = []  # what the two readings of a finished study read
    if args.judge_at:
        missing = [os.path.join(args.out, name) for name in ("summary.json", "steps.json.gz")]
    if args.token_tail_check:
        seed_dirs = [
            os.path.join(args.out, f"seed-{seed}")
            for seed in range(args.first_seed, args.first_seed + args.seeds)
        ]
        missing = [os.path.join(seed_dir, "prediction.json") for seed_dir in seed_dirs]
        missing += [os.path.join(d, "k1_return", "eval.jsonl") for d in seed_dirs]
        missing += [os.path.join(d, "k1_return_token", "checkpoint", "model") for d in seed_dirs]
    missing = [path for path in missing if not os.path.exists(path)]
    if missing:
        parser.error(
            f"no {missing[0]}: this reads a finished study; pass its --out (and its --seeds and "
            "--first-seed), or run the study first"
        )
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    return args


def token_tail_check(args) -> dict:
    """Per seed of a finished study in --out: the token arm's trained lift over k1_return, its
    prediction (the tail at pi_ref's), and the prediction with the tail at the trained token
    arm's; printed, and written to token-tail-check.json there. Trains nothing."""
    task, found = TwoModeTask(k=args.k, m=args.m), {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        seed_dir = os.path.join(args.out, f"seed-{seed}")
        last = {
            arm: trajectory(os.path.join(seed_dir, arm))[-1]["log_pi_b"]
            for arm in ("k1_return_token", "k1_return")
        }
        with open(os.path.join(seed_dir, "prediction.json")) as handle:
            predicted = json.load(handle)["log_pi_b"]
        at_tail = token_lift_at_trained_tail(seed_dir, task, beta=args.beta)
        found[seed] = {
            "trained": last["k1_return_token"] - last["k1_return"],
            "predicted": predicted["k1_return_token/sampler"] - predicted["k1_return/sampler"],
            "predicted_at_trained_tail": sum(at_tail) / len(at_tail),
            "per_phrasing_at_trained_tail": at_tail,
        }
        row = found[seed]
        print(
            f"seed {seed}: token lift trained {row['trained']:+.3f}, predicted "
            f"{row['predicted']:+.3f}, at the trained tail {row['predicted_at_trained_tail']:+.3f}"
        )
    write_json_atomic(os.path.join(args.out, "token-tail-check.json"), found)
    return found


def main(argv: list[str] | None = None) -> dict:
    """The study: every seed's start, prediction and arms, then summary.json, the report and
    pi_b.png in --out (a killed study run again keeps the starts, predictions and finished arms)."""
    args = parse_args(argv)
    if args.judge_at > 0:
        with open(os.path.join(args.out, "summary.json")) as handle:
            summary = json.load(handle)
        with gzip.open(os.path.join(args.out, "steps.json.gz")) as handle:
            steps = json.load(handle)
        rows = judge_at(summary, steps, at_step=args.judge_at)
        for arm, row in rows.items():
            print(f"margins at step {args.judge_at}, {arm}: level {row['level']}", end="")
            print(f", lift {row['lift']}" if "lift" in row else "")
        return rows
    if args.token_tail_check:
        return token_tail_check(args)
    started = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()  # loading and saving the starts: no bars
    prepared = {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        prepared[seed] = prepare_seed(seed, args)
        seconds = time.perf_counter() - started
        print(f"two_mode: seed {seed}'s start and prediction ready ({seconds:.0f} s)", flush=True)
    if args.predict_only:
        predictions = {seed: result["prediction"]["log_pi_b"] for seed, result in prepared.items()}
        write_json_atomic(os.path.join(args.out, "predictions.json"), predictions)
        print(json.dumps(predictions, indent=1))
        return predictions
    per_seed = train_arms(prepared, args)
    print(f"two_mode: every arm trained ({time.perf_counter() - started:.0f} s)", flush=True)
    summary = summarize(per_seed, args, seconds=time.perf_counter() - started)
    write_json_atomic(os.path.join(args.out, "summary.json"), summary)
    # every arm's per-step metrics, {arm: {seed: columns}}, beside the summary (gzip'd JSON)
    steps = {
        arm: {seed: per_seed[seed]["steps"][arm] for seed in per_seed} for arm in summary["arms"]
    }
    with atomic_output(os.path.join(args.out, "steps.json.gz"), mode="wb") as handle:
        handle.write(gzip.compress(json.dumps(steps).encode()))
    figure = os.path.join(args.out, "pi_b.png")
    if args.seeds == 1:
        plot_arms(summary, figure)
        print(format_tiny(summary), f"figure: {figure}", sep="\n")
    else:
        plot(summary, figure)
        print(format_report(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
