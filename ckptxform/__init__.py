"""ckptxform: declarative checkpoint conversion with an audit of every tensor.

>>> import ckptxform
>>> rules = ckptxform.load_rules("rules/aqmedai_k2_to_k25.yaml")   # doctest: +SKIP
>>> result = ckptxform.apply(rules, out="out", sources={...})       # doctest: +SKIP
"""

from ._version import __version__  # noqa: E402

from .api import apply, plan  # noqa: E402
from .engine.run.execute import ApplyResult  # noqa: E402
from .engine.plan.planner import Plan  # noqa: E402
from .errors import CkptxformError  # noqa: E402
from .rules.loader import load_rules  # noqa: E402
from .rules.model import RuleSet  # noqa: E402

__all__ = ["ApplyResult", "CkptxformError", "Plan", "RuleSet", "__version__", "apply", "load_rules", "plan"]
