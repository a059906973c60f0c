"""The output: who owns OUT, the job directory a run resumes from, the audit, the run digest, verify."""
