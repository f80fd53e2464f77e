"""The pattern table: what tf_relupool fuses, read from the op library (cc/grappler/patterns.h).

The Grappler pass (and rewrite_graph, which runs it) and the trace-time fusion under XLA
(keras_fusion) name the same patterns: both read this one table, compiled into the library. A
role is the set of op types that can play one part of a pattern ("pool": MaxPool, MaxPoolV2;
"pad": Pad, PadV2; ...); a pattern is a chain of roles from the pool's output back to z
("pool(pad(relu(z)))") with the fusers that match it ("grappler", "trace") and whether its
gradient is fused too.

    from tf_relupool import patterns
    patterns.role_ops("pad")                    # frozenset({"Pad", "PadV2"})
    [p.name for p in patterns.for_fuser("trace")]
"""
import collections
import functools

Role = collections.namedtuple("Role", "name ops condition")
Pattern = collections.namedtuple("Pattern", "name chain fusers gradient note")
FUSERS = ("grappler", "trace")


def parse_chain(text):
    """"pool(pad(relu(z)))" -> ("pool", "pad", "relu"): the roles from the pool's output back."""
    roles = []
    rest = text.strip()
    while rest != "z":
        role, paren, inner = rest.partition("(")
        if not paren or not inner.endswith(")") or not role.isidentifier():
            raise ValueError(f"pattern chain {text!r}: expected role(...(z))")
        roles.append(role)
        rest = inner[:-1]
    if not roles:
        raise ValueError(f"pattern chain {text!r} names no role")
    return tuple(roles)


def parse_table(text):
    """({role name: Role}, (Pattern, ...)) from tf_relupool_grappler_patterns' text."""
    roles, found = {}, []
    for line in text.splitlines():
        if not line.strip():
            continue
        kind, *fields = line.split("\t")
        if kind == "role" and len(fields) == 3:
            name, ops, condition = fields
            roles[name] = Role(name, frozenset(ops.split(",")), condition)
        elif kind == "pattern" and len(fields) == 5 and fields[3] in ("gradient", "forward"):
            name, chain, fusers, gradient, note = fields
            found.append(Pattern(name, parse_chain(chain), frozenset(fusers.split(",")),
                                 gradient == "gradient", note))
        else:
            raise ValueError(f"pattern table line {line!r}: not a role or pattern")
    for p in found:
        unknown = [r for r in p.chain if r not in roles]
        if unknown or not p.fusers <= set(FUSERS):
            raise ValueError(f"pattern {p.name}: unknown roles {unknown} or fusers {p.fusers}")
    return roles, tuple(found)


@functools.lru_cache(maxsize=None)
def table():
    """({role name: Role}, (Pattern, ...)): the table of the loaded library."""
    from tf_relupool import grappler
    return parse_table(grappler.pattern_table_text())


def role_ops(role):
    """The op types that play `role` (KeyError for a role the table does not have)."""
    return table()[0][role].ops


def for_fuser(fuser):
    """The patterns the fuser ("grappler" or "trace") matches, in the table's order."""
    if fuser not in FUSERS:
        raise ValueError(f"fuser must be one of {FUSERS}, got {fuser!r}")
    return tuple(p for p in table()[1] if fuser in p.fusers)
