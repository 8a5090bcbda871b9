"""The chat: the session that runs a turn and re-reads the log when the gate says so, and the saved state a reopened
chat resumes from."""
