"""Parity validation: run the source and the converted model on the same inputs and compare every
output (max absolute and relative error, cosine similarity, NaN/Inf that the source does not
have, and for integer or string outputs the share of elements that differ)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from converters.runners import Runner


@dataclass(frozen=True)
class Tolerances:
    """Pass criteria. A float output passes when no new NaN/Inf appears, every element satisfies
    |converted - source| <= atol + rtol * |source| (skipped when atol is None), the cosine
    similarity is at least `min_cosine`, and the relative L2 error ||converted - source|| /
    ||source|| is at most `max_norm_error` (cosine alone misses a scaled output). Integer and
    string outputs (class labels) pass when at most `max_mismatch` of their elements differ.
    A bound set to None is not checked."""

    atol: float | None
    rtol: float | None
    min_cosine: float | None
    max_norm_error: float | None
    max_mismatch: float


DEFAULT_TOLERANCES = {
    "fp32": Tolerances(1e-4, 1e-3, min_cosine=0.9999, max_norm_error=None, max_mismatch=0.0),
    "fp16": Tolerances(1e-2, 1e-2, min_cosine=0.999, max_norm_error=None, max_mismatch=0.01),
    # int8 errors scale with each tensor's range, so element-wise bounds would need per-model
    # tuning; cosine and relative L2 error are the portable checks (per-channel int8 reaches a
    # cosine of ~0.99, i.e. a relative error of ~0.14).
    "int8": Tolerances(None, None, min_cosine=0.98, max_norm_error=0.25, max_mismatch=0.05),
}


def tolerances_for(
    precision: str,
    atol: float | None = None,
    rtol: float | None = None,
    min_cosine: float | None = None,
    max_norm_error: float | None = None,
) -> Tolerances:
    """The precision's defaults with any value the user set."""
    base = DEFAULT_TOLERANCES[precision]
    if rtol is None:  # an atol set for int8 (no default rtol) is a pure absolute bound
        rtol = 0.0 if base.rtol is None and atol is not None else base.rtol
    return replace(
        base,
        atol=base.atol if atol is None else atol,
        rtol=rtol,
        min_cosine=base.min_cosine if min_cosine is None else min_cosine,
        max_norm_error=base.max_norm_error if max_norm_error is None else max_norm_error,
    )


@dataclass
class OutputCheck:
    """The comparison of one output over all validation samples."""

    name: str
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    norm_error: float | None = None
    cosine: float | None = None
    mismatch: float | None = None
    new_nan_inf: int = 0
    passed: bool = True
    reasons: list[str] = field(default_factory=list)

    def fail(self, reason: str) -> None:
        self.passed = False
        self.reasons.append(reason)


@dataclass
class Validation:
    """The outcome: per-output checks, the tolerances used and the number of sample rows."""

    tolerances: Tolerances
    samples: int
    outputs: list[OutputCheck]

    @property
    def passed(self) -> bool:
        return bool(self.outputs) and all(check.passed for check in self.outputs)


def compare(
    source: Runner,
    converted: Runner,
    batches: Sequence[Mapping[str, np.ndarray]],
    tolerances: Tolerances,
) -> Validation:
    """Run both models on every batch and check each output against the tolerances."""
    names = converted.output_names
    expected: list[list[np.ndarray]] = [[] for _ in names]
    actual: list[list[np.ndarray]] = [[] for _ in names]
    checks = [OutputCheck(name) for name in names]
    samples = 0
    for feeds in batches:
        samples += len(next(iter(feeds.values()))) if feeds else 0
        want, got = source.run(feeds), converted.run(feeds)
        if len(want) != len(got):
            check = OutputCheck("(outputs)")
            check.fail(f"source has {len(want)} outputs, converted model has {len(got)}")
            return Validation(tolerances, samples, [check])
        for index, (a, b) in enumerate(zip(want, got, strict=True)):
            # Dims of 1 aside (a scikit-learn regressor's [n] is skl2onnx's [n, 1]), the shapes
            # must agree: equal sizes alone let a [batch, 2, 3] stand for a [batch, 6].
            if [d for d in a.shape if d != 1] != [d for d in b.shape if d != 1]:
                checks[index].fail(
                    f"shape {list(b.shape)} differs from the source's {list(a.shape)}"
                )
            expected[index].append(a.reshape(-1))
            actual[index].append(b.reshape(-1))
    for check, want_parts, got_parts in zip(checks, expected, actual, strict=True):
        if check.passed:
            _compare_output(
                check, np.concatenate(want_parts), np.concatenate(got_parts), tolerances
            )
    return Validation(tolerances, samples, checks)


def _compare_output(
    check: OutputCheck, source: np.ndarray, converted: np.ndarray, tol: Tolerances
) -> None:
    if source.dtype.kind != "f" and converted.dtype.kind != "f":
        check.mismatch = float(np.mean(source != converted)) if source.size else 0.0
        if source.dtype.kind in "biu" and converted.dtype.kind in "biu" and source.size:
            check.max_abs_error = float(np.max(np.abs(source.astype(np.float64) - converted)))
        if check.mismatch > tol.max_mismatch:
            check.fail(f"{check.mismatch:.2%} of elements differ (allowed {tol.max_mismatch:.2%})")
        return
    want, got = source.astype(np.float64), converted.astype(np.float64)
    finite = np.isfinite(want) & np.isfinite(got)
    check.new_nan_inf = int(np.count_nonzero(np.isfinite(want) & ~np.isfinite(got)))
    if check.new_nan_inf:
        check.fail(f"{check.new_nan_inf} NaN/Inf values where the source is finite")
    want, got = want[finite], got[finite]
    diff = np.abs(got - want)
    check.max_abs_error = float(diff.max()) if diff.size else 0.0
    nonzero = want != 0
    check.max_rel_error = float((diff[nonzero] / np.abs(want[nonzero])).max(initial=0.0))
    check.cosine = _cosine(want, got)
    norm = float(np.linalg.norm(want))
    check.norm_error = float(np.linalg.norm(got - want)) / norm if norm else float(diff.any())
    if tol.atol is not None:
        bound = tol.atol + (tol.rtol or 0.0) * np.abs(want)
        outside = int(np.count_nonzero(diff > bound))
        if outside:
            check.fail(
                f"{outside} of {diff.size} elements exceed atol {tol.atol:g} + rtol "
                f"{tol.rtol or 0.0:g} * |source|"
            )
    if tol.min_cosine is not None and check.cosine < tol.min_cosine:
        check.fail(f"cosine {check.cosine:.6f} is below {tol.min_cosine:g}")
    if tol.max_norm_error is not None and check.norm_error > tol.max_norm_error:
        check.fail(f"relative L2 error {check.norm_error:.4g} is above {tol.max_norm_error:g}")


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    if norm == 0.0:
        return 1.0 if not a.any() and not b.any() else 0.0
    return float(np.dot(a, b) / norm)
