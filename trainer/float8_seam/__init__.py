"""The trainer's one seam to float8, named apart from the float8/ library it wraps.

seam.py is what the rest of trainer/ imports (the `Float8Seam` Protocol, `build_seam`,
`float8_memory`); rules.py the rules base the three implementations share; ours.py (float8/),
reference.py (torchao.float8) and off.py the implementations; options.py which `[float8]`
options each runs, torch-free for the config checks. This file imports nothing: the config
checks import options.py before torch loads.
"""
