"""Widgets of the chat screen: conversation pane, prompt, sidebar, memory panel, status line."""
