"""A/B test of two pipelines on one workload: what ``tessellm ab`` runs.

Both pipelines stay loaded. Each first runs the workload untimed (``warmup_rounds``), then both
run the same requests for ``rounds`` rounds, interleaved with the order alternating (A B, B
A, ...), so drift over time (clock boost, other load) hits both arms alike. The throughput
ratio B / A comes from the rounds' paired ratios with the order effect removed, and an
interval that holds 1 for identical arms at least 95% of the time (``bench.intervals``).
Output agreement compares the arms' greedy outputs token for token, and their next-token
distributions (KL) on one and the same teacher-forced sequence. When either arm's requests
sample (its request parameters have a temperature above 0), each arm also draws many seeded
continuations of the agreement prompts, and ``bench.distributions`` tests whether both arms'
samples could come from one distribution.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from tessellm.bench.distributions import DistributionComparison, compare_continuations, format_comparison
from tessellm.bench.intervals import paired_ratio_ci, round_orders
from tessellm.bench.offline import BenchResult, describe_device, request_limit, run_offline, summarize, warm_up
from tessellm.bench.workloads import BenchRequest, Workload
from tessellm.core.config import PipelineConfig, apply_overrides, config_from_dict, default_config_data, read_config_file
from tessellm.core.errors import ConfigError, validation_problems
from tessellm.core.interfaces.sequence import SamplingParams

AGREEMENT_PROMPT_TOKENS = 128  # agreement prompts are cut to this; it is a check, not a benchmark
AGREEMENT_NEW_TOKENS = 32
SAMPLES_PER_REQUEST = 64  # SamplingParams.n's bound: more continuations take more requests
CHECK_OWNS = ("max_tokens", "ignore_eos", "n", "seed")  # request fields the workload and the checks set
_NEXT_KEY = re.compile(r",(?=\s*[A-Za-z_][\w.]*\s*=)")  # a comma followed by KEY=: a comma in [1, 2] is not


def split_overrides(values: list[str]) -> list[str]:
    """``--a``/``--b`` values (each ``KEY=VALUE[,KEY=VALUE...]``, repeatable) as a flat list of
    ``KEY=VALUE`` items; a comma inside a value (``x=[1, 2]``) stays in it."""
    return [part.strip() for v in values for part in _NEXT_KEY.split(v) if part.strip()]


def parse_request_params(values: list[str], flag: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``--params``/``--a-params``/``--b-params`` values (``KEY=VALUE[,KEY=VALUE...]``, repeatable,
    values in ``--set``'s YAML syntax, ``extra_args.KEY`` for a decoder's own) as a mapping of
    ``SamplingParams`` fields, on top of a copy of ``base``; ``lora`` names the LoRA adapter
    (or a list of them, null for the base model, dealt to the requests in turn). Raises
    ConfigError naming the flag and the item."""
    params: dict[str, Any] = json.loads(json.dumps(base or {}))
    for item in split_overrides(values):
        key, sep, raw = item.partition("=")
        path = key.strip().split(".")
        if not sep or not all(path):
            raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE, e.g. temperature=1.0,min_p=0.1")
        if path[0] in CHECK_OWNS:
            raise ConfigError(f"{flag} {item!r}: {path[0]} is set by the workload and the agreement checks "
                              f"(see --num-samples, --sample-tokens)")
        node = params
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _yaml_scalar(raw.strip())
    lora = params.get("lora")
    if lora is not None and not (isinstance(lora, str) or (isinstance(lora, list) and lora and all(
            n is None or isinstance(n, str) for n in lora))):
        raise ConfigError(f"{flag} lora={lora!r}: expected an adapter name or a list of them (null: the base model), "
                          f"e.g. lora=[a,b,null]")
    try:
        SamplingParams.model_validate({**{k: v for k, v in params.items() if k != "lora"}, "max_tokens": 1})
    except ValidationError as exc:
        raise ConfigError(f"{flag} {','.join(split_overrides(values))!r}: {validation_problems(exc)}") from None
    return params


def _yaml_scalar(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        return text


def requests_sample(params: dict[str, Any]) -> bool:
    """Whether requests with these parameters sample (rather than take the argmax)."""
    params = {k: v for k, v in params.items() if k != "lora"}
    return SamplingParams.model_validate({**params, "max_tokens": 1}).temperature > 0


def load_arm_configs(files: list[str], *, base: str | None = None, shared: list[str] = (),
                     a: list[str] = (), b: list[str] = (),
                     params_differ: bool = False) -> tuple[PipelineConfig, PipelineConfig]:
    """A's and B's configs, checked against the plugin registry (names, options, device)
    without loading a model. Either ``files`` (two config files) or ``base`` (a file; None: the
    embedded config) plus each arm's overrides ``a``/``b``; ``shared`` (``--set``) applies to
    both. With ``params_differ`` (the arms' request parameters differ) both arms may be the
    base config. Raises ConfigError naming the arm and the field."""
    from tessellm.core.registry import get_registry
    from tessellm.core.resolve import precheck

    if files and (base is not None or a or b):
        raise ConfigError("give either two config files (tessellm ab A.yaml B.yaml) or --config/--a/--b, not both")
    if files and len(files) != 2:
        raise ConfigError(f"give exactly two config files, A's and B's; got {len(files)}: {' '.join(files)}")
    if not files and not (a or b or params_differ):
        raise ConfigError("nothing to compare: give two config files (tessellm ab A.yaml B.yaml), "
                          "each arm's overrides (--a KEY=VALUE --b KEY=VALUE) or request parameters "
                          "(--a-params KEY=VALUE --b-params KEY=VALUE)")
    configs = []
    for arm, path, own in (("A", files[0] if files else base, a), ("B", files[1] if files else base, b)):
        data = apply_overrides(read_config_file(path) if path is not None else default_config_data(), list(shared))
        for item in split_overrides(list(own)):
            try:
                data = apply_overrides(data, [item])
            except ConfigError as exc:  # its message names --set; this override came from --a/--b
                raise ConfigError(str(exc).replace("--set", f"--{arm.lower()}", 1)) from None
        config = config_from_dict(data, f"arm {arm}" + ("" if path is None else f" (config {str(path)!r})"))
        try:
            precheck(config, get_registry())
        except ConfigError as exc:
            raise ConfigError(f"arm {arm}: {exc}") from None
        configs.append(config)
    return configs[0], configs[1]


def bootstrap_ratio_ci(a: Any, b: Any, *, seed: int = 0, resamples: int = 10_000,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile-bootstrap interval of ``mean(b) / mean(a)`` over paired rounds: each resample
    draws round indices with replacement and takes the same rounds of both arms, so drift
    shared by a round's two runs cancels. Deterministic for a given seed. (What the live A/B
    of ``tessellm ab --serve`` reports over its many request pairs; over a few offline rounds
    it is too narrow, and ``tessellm ab`` uses ``bench.intervals.paired_ratio_ci``.)"""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape or a.size == 0 or (a <= 0).any():
        raise ValueError("a and b must be equally long, non-empty 1-d sequences with positive a")
    idx = np.random.default_rng(seed).integers(0, a.size, size=(resamples, a.size))
    ratios = b[idx].mean(axis=1) / a[idx].mean(axis=1)
    low, high = np.percentile(ratios, [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


@dataclass(frozen=True)
class ArmRequest(BenchRequest):
    """A workload request with its arm's request parameters (``temperature``, ``min_p``, ...);
    the workload still sets ``max_tokens`` and ``ignore_eos``."""

    params: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams.model_validate({"temperature": 0.0, **self.params, "max_tokens": self.output_len,
                                              "ignore_eos": self.ignore_eos})


def arm_request(r: BenchRequest, request_id: str, params: dict[str, Any], index: int = 0) -> BenchRequest:
    """A copy of ``r`` named ``request_id`` that runs with ``params`` (none: as the workload
    says); a list of LoRA adapters in ``params["lora"]`` gives request ``index`` the one at
    ``index`` modulo its length."""
    params = dict(params)
    lora = params.pop("lora", None)
    if isinstance(lora, list):
        lora = lora[index % len(lora)]
    if not params:
        return dataclasses.replace(r, request_id=request_id, lora=lora)
    return ArmRequest(request_id, r.prompt_token_ids, r.output_len, r.ignore_eos, lora=lora, params=params)


def run_rounds(llm_a: Any, llm_b: Any, requests: list[BenchRequest], rounds: int, *, progress: bool = False,
               params: tuple[dict[str, Any], dict[str, Any]] = ({}, {}), warmup_rounds: int = 1,
               first: str = "A") -> tuple[list[BenchResult], list[BenchResult]]:
    """Warm both arms up (a tiny request, then ``warmup_rounds`` untimed runs of ``requests``
    each), then run ``requests`` through each arm ``rounds`` times in the orders of
    ``round_orders(rounds, first)`` (A then B, B then A, ...), with each arm's request
    ``params``. Every run starts with an empty prefix cache, so each round measures what one
    ``bench`` run does. Returns A's and B's timed results by round."""
    arms = {"a": (llm_a, params[0]), "b": (llm_b, params[1])}

    def run(arm: str, tag: str) -> BenchResult:
        llm, own = arms[arm]
        reset = getattr(llm.pipeline.cache, "reset_prefix_cache", None)
        if reset is not None:
            reset()
        # request ids must be unique among an engine's live requests: tag each run's copies
        fresh = [arm_request(r, f"{r.request_id}#{arm}{tag}", own, n) for n, r in enumerate(requests)]
        return run_offline(llm, fresh, progress=progress, warmup=False)

    for llm in (llm_a, llm_b):
        warm_up(llm, requests)
    for i in range(warmup_rounds):  # untimed: a first run pays for set-up the later ones do not
        for arm in round_orders(1, first)[0].lower():
            run(arm, f"w{i}")
    out: dict[str, list[BenchResult]] = {"a": [], "b": []}
    for i, order in enumerate(round_orders(rounds, first)):
        for arm in order.lower():
            out[arm].append(run(arm, str(i)))
    return out["a"], out["b"]


@dataclass
class Agreement:
    """How far B's outputs are from A's on the same prompts (greedy, ``max_tokens`` each)."""

    exact_match_rate: float
    mean_kl: float
    max_kl: float
    first_divergence: dict[int, int]
    """Prompt index -> first output position where B's token differs from A's."""
    num_prompts: int
    max_tokens: int


def output_agreement(llm_a: Any, llm_b: Any, prompts: list[list[int]],
                     max_tokens: int = AGREEMENT_NEW_TOKENS) -> Agreement:
    """Greedy-generate ``prompts`` through each arm (one batch, ``ignore_eos``) and compare.

    ``exact_match_rate``: share of prompts whose output token ids are identical. KL(P_A || P_B)
    of the next-token distributions is taken where both arms see the same context: the prompt
    plus A's output, teacher-forced through ``engine.score`` (float64 log-softmax); one value
    per output position, averaged and maximised over all prompts and positions. Every prompt
    plus ``max_tokens`` must fit both arms' context windows."""
    params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    outs_a = [o.token_ids for o in llm_a.generate(prompts, params, progress=False)]
    outs_b = [o.token_ids for o in llm_b.generate(prompts, params, progress=False)]
    kls, diverge = [], {}
    for i, (prompt, ta, tb) in enumerate(zip(prompts, outs_a, outs_b)):
        if ta != tb:
            diverge[i] = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        ids = list(prompt) + ta[:-1]  # row t predicts token t + 1: rows P-1 .. P+K-2 predict A's K tokens
        la = llm_a.engine.score(ids)[len(prompt) - 1:].double().log_softmax(-1)
        lb = llm_b.engine.score(ids)[len(prompt) - 1:].double().log_softmax(-1).to(la.device)
        if la.shape != lb.shape:
            raise ConfigError(f"the arms' vocabularies differ ({la.shape[-1]} vs {lb.shape[-1]} logits)")
        pa = la.exp()
        kl = torch.where(pa > 0, pa * (la - lb), 0.0).sum(-1)  # 0 log 0 = 0, even against log p_b = -inf
        kls.append(kl.clamp_min(0).cpu())  # rounding can leave -1e-17 where the arms nearly agree
    kl = torch.cat(kls)
    return Agreement(1.0 - len(diverge) / len(prompts), float(kl.mean()), float(kl.max()), diverge,
                     len(prompts), max_tokens)


def draw_continuations(llm: Any, prompts: list[list[int]], params: dict[str, Any], num_samples: int,
                       max_tokens: int, *, first_seed: int, seed_step: int = 1) -> list[list[list[int]]]:
    """``num_samples`` continuations of ``max_tokens`` tokens (``ignore_eos``) per prompt, as
    one batch of requests of at most 64 samples each (fewer if a step holds fewer sequences);
    request j has seed ``first_seed + j * seed_step``, so the draws are reproducible."""
    most = min(SAMPLES_PER_REQUEST, llm.pipeline.scheduler.max_step_seqs or SAMPLES_PER_REQUEST)
    chunks = [min(most, num_samples - start) for start in range(0, num_samples, most)]
    sampling = {k: v for k, v in params.items() if k != "lora"}  # the agreement checks run on the base model
    batch = [{**sampling, "max_tokens": max_tokens, "ignore_eos": True, "n": n,
              "seed": first_seed + (i * len(chunks) + c) * seed_step}
             for i in range(len(prompts)) for c, n in enumerate(chunks)]
    outs = llm.generate([p for p in prompts for _ in chunks], batch, progress=False)
    drawn = [[o.token_ids for o in out.outputs] for out in outs]
    return [sum(drawn[i * len(chunks):(i + 1) * len(chunks)], []) for i in range(len(prompts))]


def sampled_agreement(llm_a: Any, llm_b: Any, prompts: list[list[int]], params_a: dict[str, Any],
                      params_b: dict[str, Any], *, num_samples: int = 64, max_tokens: int = 8, seed: int = 0,
                      alpha: float = 0.05) -> DistributionComparison:
    """Draw ``num_samples`` seeded continuations of every prompt from each arm, with its request
    parameters, and test whether both arms' draws come from one distribution
    (``compare_continuations``). A's requests are seeded ``1 + 2_000_000 * seed``, then 2, 4, ...
    above it, and B's 1 above each of A's: no two samples share a generator stream (the engine
    seeds a request's sample i > 0 with ``seed * 1_000_003 + i``), so two identical arms give
    independent samples of one distribution, as the test assumes."""
    first = 1 + 2_000_000 * seed
    drawn_a = draw_continuations(llm_a, prompts, params_a, num_samples, max_tokens, first_seed=first, seed_step=2)
    drawn_b = draw_continuations(llm_b, prompts, params_b, num_samples, max_tokens, first_seed=first + 1,
                                 seed_step=2)
    return compare_continuations(drawn_a, drawn_b, alpha=alpha)


def run_ab(llm_a: Any, llm_b: Any, workload: Workload, *, seed: int = 0, num_requests: int | None = 16,
           rounds: int = 5, num_agreement_prompts: int = 8, progress: bool = False, command: str = "",
           params: tuple[dict[str, Any], dict[str, Any]] = ({}, {}), num_samples: int = 64,
           sample_tokens: int = 8, alpha: float = 0.05, warmup_rounds: int = 1) -> dict[str, Any]:
    """Draw the workload once (requests fit both arms), time it in interleaved rounds after
    ``warmup_rounds`` untimed ones (``run_rounds``, each arm with its request ``params``), put
    ``paired_ratio_ci``'s interval on the ratio, check output agreement on its first
    ``num_agreement_prompts`` prompts (0: skip) and return the report ``tessellm ab --json``
    prints. If either arm's ``params`` sample, the check also compares ``num_samples``
    continuations of ``sample_tokens`` tokens per prompt and arm (``sampled_agreement``)."""
    if rounds < 2:
        raise ConfigError(f"rounds must be at least 2 for an interval over rounds, got {rounds}")
    vocab = {llm.pipeline.spec.vocab_size for llm in (llm_a, llm_b)}
    if len(vocab) != 1:
        raise ConfigError(f"the arms' models have different vocabularies ({' vs '.join(map(str, sorted(vocab)))} "
                          f"tokens); A/B needs models that share a tokenizer")
    limit = min(request_limit(llm_a), request_limit(llm_b))
    requests = workload.requests(seed=seed, num_requests=num_requests, tokenizer=llm_a.tokenizer,
                                 max_model_len=limit, vocab_size=vocab.pop(), encode=llm_a.encode)
    runs = dict(zip("ab", run_rounds(llm_a, llm_b, requests, rounds, progress=progress, params=params,
                                     warmup_rounds=warmup_rounds)))
    tps = {arm: [sum(t.output_tokens for t in r.requests) / r.elapsed_s for r in rs] for arm, rs in runs.items()}
    report: dict[str, Any] = {}
    for arm, llm in (("a", llm_a), ("b", llm_b)):
        p = llm.pipeline
        report[arm] = {
            "config": json.loads(json.dumps({"model": p.config.model, **p.resolved.summary()}, default=str)),
            "request_params": params["ab".index(arm)],
            "kv_cache_slots": p.cache.num_blocks * p.cache.layout.block_size,
            "output_tokens_per_s": {"per_round": [round(x, 3) for x in tps[arm]],
                                    "mean": round(float(np.mean(tps[arm])), 3)},
            **{f"{key}_ms": summarize([getattr(t, f"{key}_s") for r in runs[arm] for t in r.requests])
               for key in ("ttft", "tpot", "e2e")}}
    orders = round_orders(rounds)
    ratio, (low, high) = paired_ratio_ci(tps["a"], tps["b"], orders)
    report.update(ratio=round(ratio, 4), ratio_ci95=[round(low, 4), round(high, 4)],
                  ratio_of_means=round(float(np.mean(tps["b"]) / np.mean(tps["a"])), 4),
                  exact_match_rate=None, mean_kl=None, max_kl=None,
                  divergences=[], agreement={"prompts": 0, "max_tokens": 0}, distribution=None)
    k = min(num_agreement_prompts, len(requests))
    if k:
        new = max(1, min(AGREEMENT_NEW_TOKENS, limit // 2))
        prompts = [r.prompt_token_ids[:min(AGREEMENT_PROMPT_TOKENS, limit - new)] for r in requests[:k]]
        g = output_agreement(llm_a, llm_b, prompts, new)
        report.update(exact_match_rate=round(g.exact_match_rate, 4), mean_kl=g.mean_kl, max_kl=g.max_kl,
                      divergences=[{"prompt": i, "first_divergence": j} for i, j in g.first_divergence.items()],
                      agreement={"prompts": k, "max_tokens": new})
        if requests_sample(params[0]) or requests_sample(params[1]):
            new = max(1, min(sample_tokens, limit // 2))
            prompts = [r.prompt_token_ids[:min(AGREEMENT_PROMPT_TOKENS, limit - new)] for r in requests[:k]]
            comparison = sampled_agreement(llm_a, llm_b, prompts, *params, num_samples=num_samples,
                                           max_tokens=new, seed=seed, alpha=alpha)
            report["distribution"] = {"prompts": k, "samples_per_arm": num_samples, "max_tokens": new,
                                      **comparison.as_dict()}
    devices = [describe_device(llm.pipeline.resolved.device) for llm in (llm_a, llm_b)]
    report.update(rounds=rounds, warmup_rounds=warmup_rounds, order=orders,
                  workload=workload.describe(seed, len(requests)),
                  device=devices[0] if devices[0] == devices[1] else f"A {devices[0]}; B {devices[1]}",
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"), command=command,
                  python=platform.python_version(), torch=torch.__version__)
    return report


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _params_text(params: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in _flat(params).items()) or "(the workload's: greedy)"


def format_ab_report(report: dict[str, Any]) -> str:
    """A plain-text view of a report: what differs between the arms, A beside B, the ratio with
    its interval, output agreement and, when the arms sample, the distribution test."""
    a, b, w = report["a"], report["b"], report["workload"]
    fa, fb = _flat(a["config"]), _flat(b["config"])
    diff = [f"{k}: {fa.get(k, '-')} -> {fb.get(k, '-')}" for k in fa.keys() | fb.keys()
            if fa.get(k, ()) != fb.get(k, ())]  # () marks a key only one arm has
    cell = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    rows = [("output tokens/s mean", [a["output_tokens_per_s"]["mean"], b["output_tokens_per_s"]["mean"]])]
    rows += [(f"{key} {stat}", [a[key][stat], b[key][stat]]) for key in ("ttft_ms", "tpot_ms")
             for stat in ("p50", "p90", "p99")]
    warm = report.get("warmup_rounds", 0)
    lines = [f"tessellm ab: workload {w['name']} ({w['num_requests']} requests, seed {w['seed']}), "
             f"{report['rounds']} interleaved rounds" + (f" after {warm} untimed" if warm else "")
             + f" on {report['device']}",
             "A -> B: " + ("; ".join(sorted(diff)) or "identical resolved configs" + (
                 "" if a.get("request_params") != b.get("request_params") else " (an A/A test)"))]
    if a.get("request_params") or b.get("request_params"):
        lines.append(f"request params: A {_params_text(a['request_params'])}; B {_params_text(b['request_params'])}")
    lines += [f"{'':<22}{'A':>12}{'B':>12}"] + [f"{k:<22}" + "".join(f"{cell(v):>12}" for v in vs) for k, vs in rows]
    for arm in ("a", "b"):
        lines.append(f"{arm.upper()} per round (tokens/s): "
                     + " ".join(cell(v) for v in report[arm]["output_tokens_per_s"]["per_round"]))
    low, high = report["ratio_ci95"]
    verdict = "no difference resolved" if low <= 1 <= high else ("B faster" if low > 1 else "B slower")
    lines.append(f"ratio B/A (output tokens/s): {report['ratio']:.4g}, 95% CI [{low:.4g}, {high:.4g}]: {verdict} "
                 f"(paired rounds, order effect removed)")
    if a["kv_cache_slots"] != b["kv_cache_slots"]:
        lines.append(f"note: the KV caches differ in size ({a['kv_cache_slots']} vs {b['kv_cache_slots']} slots)")
    g = report["agreement"]
    if g["prompts"]:
        lines.append(f"agreement on {g['prompts']} prompts x {g['max_tokens']} greedy tokens: exact match "
                     f"{100 * report['exact_match_rate']:.1f}%, mean KL(A||B) {report['mean_kl']:.3g}, "
                     f"max {report['max_kl']:.3g}" + (" (the arms' logits; their sampling is compared below)"
                                                      if report.get("distribution") else ""))
        lines += [f"  prompt {d['prompt']}: first differs at output token {d['first_divergence']}"
                  for d in report["divergences"]]
    if report.get("distribution"):
        lines += format_comparison(report["distribution"])
    lines.append(f"{report['date']}  $ {report['command']}")
    return "\n".join(lines)
