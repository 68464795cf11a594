"""What the operator's verbs use on a broker besides the plumbing: publishing delayed
messages and watching pick-up (publish), a publisher with a confirm window (window),
the delayed-message plugin's table (plugin_table), and what commands read of the
cancellations stream (cancellations)."""
