"""mptrain_plugins: a user's own components, outside `src/mptrain`, selected from YAML by `_target_`.

Put this folder on the path (``PYTHONPATH=examples/plugins`` or ``pip install -e examples/plugins``)
and pick a component from the command line, e.g.::

    torchrun --nproc_per_node=4 train.py parallel=tp2pp2 schedule._target_=mptrain_plugins.schedules.my_gpipe

Each module holds one kind; `docs/COMPONENTS.md` gives each kind's interface.
"""
