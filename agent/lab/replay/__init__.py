"""Replays: conversation scripts run under every eviction policy, scored, aggregated, reported.

``script`` reads the stable JSONL format (docs/REPLAY_FORMAT.md), ``locomo`` converts the
LoCoMo benchmark to it, ``recall30`` builds the thirty-turn recall scenarios, ``longchat``
the long chats (``longdemo`` runs and tabulates them for ``certchat demo long``), ``runner``
drives a ``ChatSession`` through a script, ``scoring`` judges answers, ``aggregate`` and
``report`` turn results into JSON, Markdown and plots, ``studies`` analyses certificates.
"""
