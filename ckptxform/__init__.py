"""ckptxform: declarative checkpoint conversion with an audit of every tensor.

>>> import ckptxform
>>> rules = ckptxform.load_rules("rules/aqmedai_k2_to_k25.yaml")   # doctest: +SKIP
>>> result = ckptxform.apply(rules, out="out", sources={...})       # doctest: +SKIP
"""

__version__ = "0.1.0"

from .api import apply, plan  # noqa: E402
from .engine.execute import ApplyResult  # noqa: E402
from .engine.planner import Plan  # noqa: E402
from .errors import CkptxformError  # noqa: E402
from .rules.loader import load_rules  # noqa: E402
from .rules.model import RuleSet  # noqa: E402

__all__ = ["ApplyResult", "CkptxformError", "Plan", "RuleSet", "__version__", "apply", "load_rules", "plan"]
