"""Planning: a RuleSet and the opened sources' headers in, a Plan out; no weight byte is read."""
