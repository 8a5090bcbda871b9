"""The lab: replays, demos, studies, benchmarks and offline fits. The chat never imports it."""
