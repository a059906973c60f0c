"""ckptxform: declarative checkpoint conversion with an audit of every tensor."""

from .errors import CkptxformError
from .rules.loader import load_rules
from .rules.model import RuleSet

__version__ = "0.1.0"

__all__ = ["CkptxformError", "RuleSet", "load_rules", "__version__"]
