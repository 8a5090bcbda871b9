"""certchat's terminal UI (`certchat chat`): a Textual app over the agent's ChatSession.

The UI talks to the agent only (``agent.chat.session``, ``agent.events``, the store API the
session hands out); model work runs in thread workers and comes back as messages.
"""
