"""The host-side reference decoder: the independent second opinion every fast path must match.

It calls the model's forward pass as a black box and llguidance for masks, and nothing of
specdec's masking, sampling or acceptance code: masks are unpacked, samples drawn and
logprobs computed in numpy, from the documented definitions.
"""

from .closing import BudgetOracle
from .compare import (Divergence, LogprobComparison, ServedLogprob, compare_logprobs,
                      first_divergence, report)
from .reference import OracleResult, OracleStep, ThinkingRule, reference_decode
from .unique import UniqueOracle

__all__ = ["BudgetOracle", "Divergence", "LogprobComparison", "OracleResult", "OracleStep",
           "ServedLogprob", "ThinkingRule", "UniqueOracle", "compare_logprobs",
           "first_divergence", "reference_decode", "report"]
