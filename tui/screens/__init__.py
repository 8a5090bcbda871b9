"""Screens: the chat itself, the first-run set-up, dialogs, logs and help."""
