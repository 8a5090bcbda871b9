"""certchat's agent: configuration, paths, models, the chat engine and the CLI."""
