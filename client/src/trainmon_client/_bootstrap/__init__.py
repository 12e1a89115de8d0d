"""The directory ``trainmon-run`` puts first on ``PYTHONPATH``: it holds ``sitecustomize.py``.

Nothing imports this package; it is a package only so that the wheel ships the directory.
"""
