"""Training: `schemoe train`'s arguments (args.py), the run (loop.py), the GPT it trains
(model.py), metrics and plots (report.py), resuming (resume.py)."""
