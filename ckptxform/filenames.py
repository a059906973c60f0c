"""Names of the files ckptxform writes into an output directory, shared by the planner (which
keeps a rule's ``files`` off them) and the output part (which writes them)."""

#: the audit log, one JSON object per line
AUDIT_FILE = "ckptxform_audit.jsonl"
#: the model config a rule's ``config`` section writes (``output.config_file`` may rename it)
CONFIG_FILE = "config.json"
