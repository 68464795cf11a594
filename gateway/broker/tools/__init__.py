"""What the operator's verbs use on a broker besides the plumbing: publishing delayed
messages and watching pick-up (publish), a publisher with a confirm window (window), and
the delayed-message plugin's table (plugin_table)."""
