#!/usr/bin/env python
"""Check the GitHub Actions workflows in .github/workflows/ (they cannot run here): prints `PASS: ...` / `FAIL: ...`.

    python .ci/check_workflows.py

Checks, per workflow file: it parses as YAML (PyYAML, installed with the docs stack) and has what GitHub needs to
run it: `name`, `on` (triggers), `jobs`, and in every job `runs-on` and a non-empty list of `steps`, each with `uses`
or `run`. Then the two workflows this project expects:
  test.yml   runs on push and pull_request, and runs the README's dev install command and test command (the two lines
             .ci/run takes from README.md), so that CI and the README cannot drift apart, and `pytest tests` as .ci/run does;
  docs.yml   builds the site with .ci/build_docs.py and publishes it with actions/upload-pages-artifact and
             actions/deploy-pages, with the `pages: write` and `id-token: write` permissions that needs.
Exit status 1 if any check failed.
"""
import re, sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / '.github' / 'workflows'
failed = False


def report(name, problems):
    global failed
    problems = [p for p in problems if p]
    if problems: failed = True; print(f'FAIL: workflow {name}: ' + '; '.join(problems))
    else: print(f'PASS: workflow {name}')


def readme_cmd(pattern):
    "The first line of README.md that matches the regex `pattern` (the lines .ci/run runs)."
    readme = ROOT / 'README.md'
    lines = readme.read_text(encoding='utf-8').splitlines() if readme.exists() else []
    return next((l.strip() for l in lines if re.match(pattern, l)), None)


def steps_of(wf):
    return [s for job in (wf.get('jobs') or {}).values() if isinstance(job, dict) for s in (job.get('steps') or []) if isinstance(s, dict)]


def structure(wf):
    "What GitHub needs to run a workflow file."
    if not isinstance(wf, dict): return ['is not a YAML mapping']
    probs = [f'has no `{k}`' for k in ('name', 'jobs') if not wf.get(k)]
    if not (wf.get('on') or wf.get(True)): probs.append('has no `on` (triggers)')   # YAML 1.1 reads a bare `on` key as True
    for jn, job in (wf.get('jobs') or {}).items():
        if not isinstance(job, dict): probs.append(f'job {jn} is not a mapping'); continue
        if not job.get('runs-on'): probs.append(f'job {jn} has no `runs-on`')
        steps = job.get('steps')
        if not isinstance(steps, list) or not steps: probs.append(f'job {jn} has no `steps`'); continue
        for i, s in enumerate(steps):
            if not isinstance(s, dict) or not (s.get('uses') or s.get('run')): probs.append(f'job {jn} step {i + 1} has neither `uses` nor `run`')
    return probs


def main():
    files = sorted(WORKFLOWS.glob('*.yml')) + sorted(WORKFLOWS.glob('*.yaml'))
    if not files: report('files', [f'no workflow in {WORKFLOWS.relative_to(ROOT)}']); return 1
    wfs = {}
    for f in files:
        try: wfs[f.name] = yaml.safe_load(f.read_text(encoding='utf-8'))
        except yaml.YAMLError as e: report(f.name, [f'is not valid YAML: {str(e).splitlines()[0]}']); continue
        report(f.name, structure(wfs[f.name]))

    test = wfs.get('test.yml')
    probs = [] if test is not None else ['.github/workflows/test.yml is missing']
    if isinstance(test, dict):
        on = test.get('on', test.get(True)) or {}
        on = [on] if isinstance(on, str) else list(on)
        probs += [f'does not run on {t}' for t in ('push', 'pull_request') if t not in on]
        runs = [str(s.get('run', '')).strip() for s in steps_of(test)]
        install, tst = readme_cmd(r'^pip install .*\[dev\]'), readme_cmd(r'^nbdev_test( |$)')     # as .ci/run reads them
        if install is None or tst is None: probs.append('README.md shows no dev install (pip install ... ".[dev]") or test (nbdev_test) command')
        else:
            if install not in runs: probs.append(f'no step runs the README install command `{install}`')
            if not any(r == tst or r.startswith(tst + ' ') for r in runs): probs.append(f'no step runs the README test command `{tst}`')
        if (ROOT / 'tests').is_dir() and not any('pytest tests' in r for r in runs): probs.append('no step runs `pytest tests` (as .ci/run does)')
    report('test.yml runs the README install and test commands on push and pull_request', probs)

    docs = wfs.get('docs.yml')
    probs = [] if docs is not None else ['.github/workflows/docs.yml is missing']
    if isinstance(docs, dict):
        steps = steps_of(docs)
        uses = [str(s.get('uses', '')) for s in steps]
        if not any('.ci/build_docs.py' in str(s.get('run', '')) for s in steps): probs.append('no step runs .ci/build_docs.py')
        for action in ('actions/upload-pages-artifact', 'actions/deploy-pages'):
            if not any(u.split('@')[0] == action for u in uses): probs.append(f'does not use {action}')
        perms = docs.get('permissions') or {}
        for k in ('pages', 'id-token'):
            if perms.get(k) != 'write': probs.append(f'needs `permissions: {k}: write`')
    report('docs.yml builds the site and deploys it to GitHub Pages', probs)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
