"""Rollouts from vLLM vs transformers generate, side by side: same model, weights and prompts.

One run, one process, one small random Qwen2 (hidden 512, 4 layers, head size 64), built by code:

1. The "trainer" perturbs the saved weights and pushes them into the vLLM engine with
   ``sync_weights``; the hf engine generates through the trainer's model itself.
2. ``greedy_match``: greedy completions of both engines agree token for token (after the sync).
3. ``max_logprob_diff``: for every token vLLM sampled in the last timed run, |engine log-prob -
   trainer log-prob|, the trainer's from a full-sequence forward through ``loss.py`` in float32
   with the sampler's temperature and min-p replayed. Excluded (and counted): positions where a
   token's logit sits within MIN_P_TOLERANCE of the min-p threshold, so close that engine and
   trainer, whose float32 logits differ by ~1e-5, may keep or drop it differently; the mass of
   such a token is ~min_p * p_max, which moves log Z by up to ~1e-2.
   ``max_logprob_diff_all_positions`` is the max without the exclusion.
4. Throughput: 16 prompts x n = 8 x up to 128 new tokens with the paper's sampler (T = 1.0,
   min_p = 0.01), each engine warmed once, then timed ``--repeats`` times, alternating, each run
   with its own seed. tokens/s counts the completion tokens returned (EOS ends some early, alike
   for both: same distribution); the reported rate is each engine's best run (the CPU is shared:
   other jobs only ever slow a run down, so the fastest is the least disturbed, as in timeit).

Prints one JSON object as the last line of stdout. Goal: vllm_over_hf_speedup >= 2.5 on 2 CPU
cores. Run: ``python bench/rollout.py`` (about 3 minutes on 2 idle cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import loss  # noqa: E402
import rollout  # noqa: E402
from extras import demo  # noqa: E402
from extras import hf_engine as hf_backend  # noqa: E402
from task.problems import SYSTEM_PROMPT  # noqa: E402

MIN_P_TOLERANCE = 2e-4  # in logits / T; >= 3x the largest engine-trainer log-prob gap without min-p
QUESTIONS = (
    "What is {a} + {b}?",
    "Compute {a} times {b}.",
    "A train travels {a} km in {b} hours. What is its average speed?",
    "Find the remainder when {a}{b} is divided by 7.",
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.01)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per engine after one warm-up"
    )
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument(
        "--enforce-eager", type=int, default=-1, help="1/0; -1: rollout.py's default"
    )
    return parser.parse_args(argv)


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` chat-templated prompts with the paper's system prompt, as token ids."""
    prompts = []
    for i in range(count):
        question = QUESTIONS[i % len(QUESTIONS)].format(a=17 * i + 3, b=i + 2)
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
        ]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return prompts


def perturbed_policy(model_dir: str, scale: float = 0.1) -> torch.nn.Module:
    """The "trainer's" model: the saved weights plus seeded noise, so a sync is needed.

    The noise is 5x the init scale: the random model's greedy completions merely repeat the
    last token, the perturbed one's are varied (see greedy_distinct_fraction), so
    greedy_match says something.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return model


@torch.no_grad()
def trainer_logprobs(
    model, prompt: list[int], completions: list[rollout.Completion], temperature, min_p
):
    """log pi(y_t) of each completion under the trainer, as the loss computes them (float32),
    and whether the min-p mask at each position is ambiguous (a token at its threshold)."""
    width = max(len(c.token_ids) for c in completions)
    ids = torch.full((len(completions), len(prompt) + width), 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, c in enumerate(completions):
        ids[row, : len(prompt) + len(c.token_ids)] = torch.tensor(prompt + c.token_ids)
        mask[row, : len(prompt) + len(c.token_ids)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logits = logits[:, len(prompt) - 1 : -1]  # [n, T, V], aligned with the completion tokens
    logps, _ = loss.token_logps_and_entropies(logits, ids[:, len(prompt) :], temperature, min_p)
    if min_p > 0:
        z = logits / temperature
        margin = z - z.amax(dim=-1, keepdim=True) - torch.log(torch.tensor(min_p))
        ambiguous = (margin.abs() < MIN_P_TOLERANCE).any(dim=-1)  # [n, T]
    else:
        ambiguous = torch.zeros(logps.shape, dtype=torch.bool)
    return [
        (logps[row, : len(c.token_ids)], ambiguous[row, : len(c.token_ids)])
        for row, c in enumerate(completions)
    ]


def timed(engine, prompts, sampling):
    start = time.perf_counter()
    groups = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    return groups, seconds, sum(len(c.token_ids) for group in groups for c in group)


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as model_dir:
        demo.save_tiny_model(
            model_dir,
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            num_heads=args.hidden_size // 64,
            max_position_embeddings=args.max_model_len,
        )
        policy = perturbed_policy(model_dir)
        extra = {} if args.enforce_eager < 0 else {"enforce_eager": bool(args.enforce_eager)}
        start = time.perf_counter()
        vllm_engine = rollout.make_engine(
            model_dir, max_model_len=args.max_model_len, dtype="float32", **extra
        )
        startup_s = time.perf_counter() - start
        hf_engine = hf_backend.make_engine(
            model_dir, max_model_len=args.max_model_len, model=policy
        )
        prompts = chat_prompts(hf_engine.tokenizer, args.prompts)

        start = time.perf_counter()
        vllm_engine.sync_weights(policy)
        sync_s = time.perf_counter() - start

        greedy = rollout.SamplingConfig(n=1, temperature=0.0, max_tokens=args.max_tokens)
        vllm_greedy = vllm_engine.generate(prompts, greedy)  # also vLLM's warm-up
        hf_greedy = hf_engine.generate(prompts, greedy)
        greedy_match = all(a[0].token_ids == b[0].token_ids for a, b in zip(vllm_greedy, hf_greedy))
        distinct = statistics.mean(
            len(set(g[0].token_ids)) / len(g[0].token_ids) for g in hf_greedy
        )

        def sampling(seed):
            return rollout.SamplingConfig(
                n=args.n,
                temperature=args.temperature,
                min_p=args.min_p,
                max_tokens=args.max_tokens,
                seed=seed,
            )

        warm_up = rollout.SamplingConfig(
            n=args.n, temperature=args.temperature, min_p=args.min_p, max_tokens=8
        )
        timed(vllm_engine, prompts, warm_up)  # warm-up at the timed batch shape
        timed(hf_engine, prompts, warm_up)
        rates = {"vllm": [], "hf": []}
        seconds = {"vllm": [], "hf": []}
        vllm_samples = []
        for repeat in range(args.repeats):
            for name, engine in (("vllm", vllm_engine), ("hf", hf_engine)):
                groups, secs, tokens = timed(engine, prompts, sampling(100 + repeat))
                rates[name].append(tokens / secs)
                seconds[name].append(secs)
                if name == "vllm":
                    vllm_samples = groups

        diffs, ambiguous = [], []
        for prompt, group in zip(prompts, vllm_samples):
            for c, (ref, unsure) in zip(
                group, trainer_logprobs(policy, prompt, group, args.temperature, args.min_p)
            ):
                diffs.append((torch.tensor(c.logprobs) - ref).abs())
                ambiguous.append(unsure)
        diffs, ambiguous = torch.cat(diffs), torch.cat(ambiguous)
        vllm_engine.close()

    vllm_rate, hf_rate = max(rates["vllm"]), max(rates["hf"])
    result = {
        "greedy_match": greedy_match,
        "greedy_distinct_fraction": round(distinct, 2),
        "max_logprob_diff": diffs[~ambiguous].max().item(),
        "max_logprob_diff_all_positions": diffs.max().item(),
        "min_p_ambiguous_positions": f"{int(ambiguous.sum())} of {ambiguous.numel()}",
        "vllm_tokens_per_s": round(vllm_rate, 1),
        "hf_tokens_per_s": round(hf_rate, 1),
        "vllm_over_hf_speedup": round(vllm_rate / hf_rate, 2),
        "vllm_seconds": [round(s, 2) for s in seconds["vllm"]],
        "hf_seconds": [round(s, 2) for s in seconds["hf"]],
        "vllm_startup_s": round(startup_s, 1),
        "sync_weights_s": round(sync_s, 3),
        "shape": (
            f"{args.prompts} prompts x n={args.n} x {args.max_tokens} tokens, "
            f"prompt {len(prompts[0])} tokens"
        ),
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
