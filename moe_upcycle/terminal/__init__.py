"""How the tool behaves as a process: signals, progress on every long step, quiet libraries, tables that fit."""
