"""Forensics: the evidence of a hang, taken and read.

Stack dumps written by faulthandler and read back (`dump_file`, `stacks`), native stacks
through py-spy (`native_stacks`), torch's Flight Recorder traces digested (`fr_digest`).
Used by the daemon (which takes the evidence) and the launcher (which reads it into a
verdict).

May import: the core and ft_client's vocabulary. Never the daemon, the launcher or the views.
"""
