"""Fault-injection and hostile-agent suite: kills, races, bad proposals, broken hooks and files."""
