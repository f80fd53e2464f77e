"""What to recompute under a memory budget: a pure function of the candidates, no TensorFlow.

The decision half of a memory budget for recomputing convolutions (docs/activations.md,
"Recomputing convolutions: the planner"); the mechanism that carries a plan out is separate and
not part of this module.

A candidate is one tensor that stock's backward pass keeps and a recomputation can give back
instead: what keeping it costs (`bytes`), what recomputing it costs (`flops`, from COSTS) and
the candidates it is recomputed from, which must then be recomputed too (`needs`): a BN's output
recomputed from a convolution's kept input needs the convolution's output recomputed first.

`plan(candidates, budget)` recomputes the cheapest work per byte first. It grows one order over
all candidates: at each step the candidate whose recomputation, with the needs not yet chosen,
adds the fewest FLOPs per byte it frees (ties: the fewer FLOPs, then the name), and takes the
shortest prefix of that order that leaves at most `budget` of the candidates' bytes kept. So a
lower budget recomputes a superset of what a higher one does (its kept bytes never grow), 1
recomputes nothing and 0 everything. The order is the one a greedy knapsack takes; it is not
claimed to be the least-FLOPs choice for every budget (that one need not be monotone).
"""
import collections
import math
import numbers

Candidate = collections.namedtuple("Candidate", "name bytes flops needs")
Candidate.__doc__ = """One tensor the backward pass may recompute instead of keeping.

name: unique; bytes: what keeping it costs (>= 0); flops: what recomputing it costs, given its
needs (>= 0); needs: names of the candidates it is recomputed from (recomputed with it)."""

Plan = collections.namedtuple("Plan", "recompute kept_bytes total_bytes flops")
Plan.__doc__ = """plan()'s result: the names to recompute, in an order in which each comes after
its needs; the candidates' bytes still kept, and in all; the FLOPs recomputing adds."""

Cost = collections.namedtuple("Cost", "kind flops_per_output how")

#: FLOPs of recomputing one output element, by kind of op; `flops()` multiplies by the output's
#: element count. Adding a kind is a row here and a case in tests/test_recompute_plan.py.
COSTS = {c.kind: c for c in (
    Cost("elementwise", lambda **_: 1, "an activation, a cast, an Add: one operation per element"),
    Cost("batch_norm", lambda **_: 2, "z * inv + shift with the forward's per-channel statistics"),
    Cost("conv", lambda kernel_elements, in_channels, groups=1, **_:
         2 * kernel_elements * in_channels // groups,
         "a multiply-add per kernel tap and input channel of its group (Conv1D/2D/3D)"),
    Cost("depthwise_conv", lambda kernel_elements, **_: 2 * kernel_elements,
         "a multiply-add per kernel tap (one input channel per output channel)"),
    Cost("dense", lambda in_features, **_: 2 * in_features,
         "a multiply-add per input feature"),
)}


def flops(kind, output_elements, **shape):
    """FLOPs of recomputing `output_elements` elements of an op of `kind` (a COSTS row; `shape`:
    what its row reads, e.g. kernel_elements and in_channels for "conv")."""
    if kind not in COSTS:
        raise ValueError(f"kind: expected one of {sorted(COSTS)}, got {kind!r}")
    _check_count("output_elements", output_elements)
    return output_elements * COSTS[kind].flops_per_output(**shape)


def plan(candidates, budget):
    """The Plan that keeps at most `budget` (a number in [0, 1]) of the candidates' bytes,
    recomputing the cheapest work per byte first (module docstring).

    Raises:
      ValueError: `budget` is not a number in [0, 1]; a candidate's name repeats, its bytes or
        flops are not non-negative numbers, or its needs name an unknown candidate or a cycle.
    """
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not (
            0 <= budget <= 1):
        raise ValueError(f"budget: expected a number in [0, 1], got {budget!r}")
    by_name = _checked(candidates)
    total = sum(c.bytes for c in by_name.values())
    order = _order(by_name)
    allowed = budget * total
    kept, chosen, cost = total, [], 0
    for name in order:
        if kept <= allowed:
            break
        chosen.append(name)
        kept -= by_name[name].bytes
        cost += by_name[name].flops
    return Plan(tuple(chosen), kept, total, cost)


def recompute_order(candidates):
    """Every candidate's name, in the order plan() recomputes them: each after its needs, by
    least FLOPs added per byte freed (module docstring)."""
    return _order(_checked(candidates))


def _order(by_name):
    """recompute_order of checked candidates ({name: Candidate})."""
    done, order = set(), []
    while len(done) < len(by_name):
        best = None
        for name in sorted(by_name):
            if name in done:
                continue
            group = _closure(name, by_name, done)
            freed = sum(by_name[n].bytes for n in group)
            added = sum(by_name[n].flops for n in group)
            key = (added / freed if freed else math.inf, added, name)
            if best is None or key < best[0]:
                best = (key, group)
        for n in _needs_first(best[1], by_name):
            done.add(n)
            order.append(n)
    return order


def _closure(name, by_name, done):
    """`name` and the needs it pulls in that are not in `done`."""
    group, stack = set(), [name]
    while stack:
        n = stack.pop()
        if n in group or n in done:
            continue
        group.add(n)
        stack.extend(by_name[n].needs)
    return group


def _needs_first(group, by_name):
    """The names of `group`, each after its needs inside it (ties by name)."""
    out, placed = [], set()
    while len(out) < len(group):
        for n in sorted(group - placed):
            if all(m in placed or m not in group for m in by_name[n].needs):
                out.append(n)
                placed.add(n)
                break
    return out


def _check_count(what, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0 or (
            isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{what}: expected a non-negative number, got {value!r}")


def _checked(candidates):
    """{name: Candidate} after checking names, counts and needs (plan()'s ValueErrors)."""
    by_name = {}
    for c in candidates:
        if not isinstance(c, Candidate):
            raise ValueError(f"candidates: expected Candidate tuples, got {c!r}")
        if c.name in by_name:
            raise ValueError(f"candidates: the name {c.name!r} repeats")
        _check_count(f"candidate {c.name!r}'s bytes", c.bytes)
        _check_count(f"candidate {c.name!r}'s flops", c.flops)
        by_name[c.name] = c
    for c in by_name.values():
        unknown = [n for n in c.needs if n not in by_name]
        if unknown:
            raise ValueError(f"candidate {c.name!r}'s needs: unknown {unknown}")
    state = {}  # name -> "open" while its needs are walked, "done" after

    def visit(name, path):
        if state.get(name) == "done":
            return
        if state.get(name) == "open":
            raise ValueError(f"candidates' needs: a cycle through {' -> '.join(path + [name])}")
        state[name] = "open"
        for n in by_name[name].needs:
            visit(n, path + [name])
        state[name] = "done"
    for name in sorted(by_name):
        visit(name, [])
    return by_name
