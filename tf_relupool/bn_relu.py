"""The name `enable_recompute(bn_relu=True)` had before it covered every activation: the
activation recomputation is tf_relupool/segments.py (its tables: segment_table.py). Kept so that
code written against it goes on working."""
from tf_relupool.segments import (  # noqa: F401
    BARRIER_ENV_VAR, barrier_kind, installed, relu_input, set_enabled, stats)
