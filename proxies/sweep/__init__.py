"""YAML scaling sweeps: expand a file into points (schema), launch each as its own MPI job
(launch), record each finished point in results/<name>/results.jsonl (results), report
speed-up, efficiency and breakdown as a table, a CSV and plots (report).

    python -m proxies sweep configs/smoke.yaml          # run (a rerun resumes)
    python -m proxies sweep FILE --print-commands       # or --sbatch job.sh
    python -m proxies report results/smoke              # table, CSV, plots again
"""
