"""`spectool audit`: does speculative decoding reproduce plain decoding? Measured, not assumed.

Greedy: plain and speculative greedy decoding of the same prompts; for each request the
first output position where they differ is reported with the target's logits there (a
plain causal forward over the prompt and the common prefix): the two tokens' logit gap and
the top-2 margin. A gap below the dtype's rounding at that magnitude is a near-tie (kernels
that sum in another order may flip it: expected in the default mode in bf16); any other
divergence is a bug.

Sampled: each prompt is decoded ``samples`` times, plainly and speculatively (seeded), and
at each of the first ``positions`` generated positions after the prefill token the two
token distributions are compared with a chi-square test of homogeneity (tokens seen fewer
than ``MIN_EXPECTED`` times expected are pooled). Each test runs at ``alpha / tests``, so the
whole audit raises a false alarm with probability at most ``alpha`` (Bonferroni).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from spectool.trace import reference as ref

MIN_EXPECTED = 5.0


@dataclass(frozen=True)
class GreedyDivergence:
    """The first output position where speculative greedy differs from plain greedy."""

    request: int
    position: int
    plain: int
    speculative: int
    gap: float
    margin: float
    near_tie: bool

    def __str__(self) -> str:
        kind = "near-tie" if self.near_tie else "bug"
        return (f"request {self.request}, output token {self.position}: plain {self.plain}, speculative "
                f"{self.speculative} (logit gap {self.gap:.4g}, top-2 margin {self.margin:.4g}): {kind}")


@dataclass(frozen=True)
class DistributionTest:
    """One chi-square test of the token distribution at one position of one prompt."""

    request: int
    position: int
    chi2: float
    dof: int
    p_value: float
    plain: dict[int, int]
    speculative: dict[int, int]

    def __str__(self) -> str:
        def top(c: dict[int, int]) -> str:
            total = sum(c.values()) or 1
            return ", ".join(f"{t}: {n / total:.3f}" for t, n in sorted(c.items(), key=lambda kv: -kv[1])[:6])

        return (f"prompt {self.request}, output token {self.position}: chi2 {self.chi2:.2f} on {self.dof} dof, "
                f"p = {self.p_value:.3g}; plain {{{top(self.plain)}}}, speculative {{{top(self.speculative)}}}")


@dataclass
class AuditReport:
    """Greedy divergences or distribution tests, and which of them are failures."""

    greedy: list[GreedyDivergence] = field(default_factory=list)
    tests: list[DistributionTest] = field(default_factory=list)
    threshold: float = 0.0  # per-test p-value below which a test fails

    @property
    def failures(self) -> list:
        bad = [d for d in self.greedy if not d.near_tie]
        return bad + [t for t in self.tests if t.p_value < self.threshold]


def greedy_audit(plain, speculative, prompts: list, max_new_tokens: int) -> AuditReport:
    """Plain vs speculative greedy on ``prompts`` (two engines over one target)."""
    import torch

    a = plain.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0, record=False).token_ids
    b = speculative.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0, record=False).token_ids
    target = plain.target
    dtype = str(target.dtype).replace("torch.", "")
    report = AuditReport()
    for i, (x, y) in enumerate(zip(a, b)):
        j = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if j is None:
            continue
        prompt = target.encode(prompts[i]) if isinstance(prompts[i], str) else list(prompts[i])
        seq = prompt + list(x[:j])
        tokens = torch.tensor([seq], device=target.device)
        positions = torch.arange(len(seq), device=target.device)[None]
        with torch.no_grad():
            logits = target.model.logits(target.model(tokens, positions))[0, -1].float().cpu()
        top2 = logits.topk(2).values
        gap = abs(float(logits[x[j]] - logits[y[j]]))
        magnitude = max(abs(float(logits[x[j]])), abs(float(logits[y[j]])))
        report.greedy.append(GreedyDivergence(i, j, int(x[j]), int(y[j]), gap, float(top2[0] - top2[1]),
                                              ref.is_near_tie(gap, magnitude, dtype)))
    return report


def chi2_homogeneity(a: Counter, b: Counter) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of a 2 x K contingency table, rare tokens pooled."""
    import torch

    na, nb = sum(a.values()), sum(b.values())
    total = na + nb
    bins, pooled = [], [0, 0]
    for t in set(a) | set(b):
        count = a.get(t, 0) + b.get(t, 0)
        if min(na, nb) * count / total < MIN_EXPECTED:
            pooled[0] += a.get(t, 0)
            pooled[1] += b.get(t, 0)
        else:
            bins.append((a.get(t, 0), b.get(t, 0)))
    if sum(pooled):
        bins.append(tuple(pooled))
    if len(bins) < 2:
        return 0.0, 0, 1.0
    chi2 = 0.0
    for ca, cb in bins:
        col = ca + cb
        for observed, row in ((ca, na), (cb, nb)):
            expected = row * col / total
            chi2 += (observed - expected) ** 2 / expected
    dof = len(bins) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(chi2 / 2, dtype=torch.float64)))
    return chi2, dof, p


def sampled_audit(plain, speculative, prompts: list, samples: int = 400, positions: int = 2,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                  alpha: float = 1e-3) -> AuditReport:
    """Chi-square tests of the first ``positions`` tokens after the prefill token, per prompt."""
    report = AuditReport()
    outputs = []
    for engine, offset in ((plain, 0), (speculative, 1)):
        outs = []
        for i, prompt in enumerate(prompts):
            r = engine.generate([prompt] * samples, max_new_tokens=positions + 1, temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed + 1000 * i + offset, record=False,
                                ignore_eos=True)
            outs.append(r.token_ids)
        outputs.append(outs)
    for i in range(len(prompts)):
        for j in range(1, positions + 1):
            a = Counter(t[j] for t in outputs[0][i] if len(t) > j)
            b = Counter(t[j] for t in outputs[1][i] if len(t) > j)
            chi2, dof, p = chi2_homogeneity(a, b)
            report.tests.append(DistributionTest(i, j, chi2, dof, p, dict(a), dict(b)))
    report.threshold = alpha / max(len(report.tests), 1)
    return report
