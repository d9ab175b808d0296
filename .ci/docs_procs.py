"""nbdev's docs processors for .ci/build_docs.py: nbdev's own `FilterDefaults`, plus one guard.

To render `show_doc`, nbdev runs every exported cell and every cell that contains an import, including cells
flagged `#| slow` or `#| gpu` (settings.ini `tst_flags`), which would train models or need a GPU while the docs
build. `skip_flagged` marks those cells `eval: false` before nbdev's `exec_show_docs` runs, so the docs build
never runs what `nbdev_test` skips. (It lives in its own module so that the worker processes can import it.)
"""
from nbdev.config import get_config
from nbdev.processors import FilterDefaults, exec_show_docs


def skip_flagged(cell):
    "Don't let nbdev's show_doc pass run a cell flagged with one of settings.ini's `tst_flags` (slow, gpu)."
    if cell.cell_type != 'code' or not getattr(cell, 'directives_', None): return
    if set(get_config().tst_flags.split()) & cell.directives_.keys(): cell.directives_['eval:'] = ['false']


class DocsFilter(FilterDefaults):
    "nbdev's docs processors with `skip_flagged` just before `exec_show_docs`."
    def base_procs(self):
        procs = list(super().base_procs())
        i = procs.index(exec_show_docs)
        return procs[:i] + [skip_flagged] + procs[i:]
