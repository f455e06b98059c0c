"""Native (C++) parts of spectool."""
