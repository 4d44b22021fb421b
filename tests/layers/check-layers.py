#!/usr/bin/python3
"""Check the layering rule of lib/ (lib/README.md): each folder includes
only itself and the folders its row in RULES names; kernels/ includes only
lib/common; lib/ never includes the front end (cmd/cli); no file-level
include cycle anywhere in lib/, kernels/ or cmd/cli; lib/ and kernels/
read no environment variables.  Prints TAP; exits 1 on any violation."""
import os, re, sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
RULES = {  # folder: folders it may include (besides itself)
    'common': [],
    'format': ['common'],
    'model':  ['common', 'format'],
    'attn':   ['common', 'model'],
    'quant':  ['common', 'format', 'attn'],
    'policy': ['common', 'format', 'model', 'attn', 'quant'],
    'gpu':    ['common', 'format', 'model', 'attn', 'quant', 'policy', 'kernels'],
    'engine': ['common', 'format', 'model', 'attn', 'quant', 'policy', 'gpu'],
    'tree':   ['common', 'format', 'quant'],
    'eval':   ['common', 'format', 'model', 'attn', 'quant', 'policy', 'gpu', 'engine',
               'tree', 'kernels'],
}
INC = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
kernel_files = set(os.listdir(os.path.join(ROOT, 'kernels')))

def rel(p): return os.path.relpath(p, ROOT)

def resolve(src, name):
    """The file an include names: lib/<name>, kernels/<name>, cmd/cli/<name>
    or beside the including file."""
    for base in (os.path.dirname(src), os.path.join(ROOT, 'lib'),
                 os.path.join(ROOT, 'kernels'), os.path.join(ROOT, 'cmd', 'cli')):
        p = os.path.normpath(os.path.join(base, name))
        if os.path.isfile(p): return p
    return None

def folder_of(p):
    r = rel(p).split(os.sep)
    if r[0] == 'lib' and len(r) >= 3: return r[1]
    if r[0] == 'kernels': return 'kernels'
    if r[:2] == ['cmd', 'cli']: return 'cli'
    return 'other'

files = []
for top in ('lib', 'kernels', os.path.join('cmd', 'cli')):
    for dp, _, fn in os.walk(os.path.join(ROOT, top)):
        files += [os.path.join(dp, f) for f in fn if f.endswith(('.c', '.h', '.cu', '.cuh'))]
files.sort()

bad, n = [], 0
graph = {}
stray = [rel(p) for p in files if rel(p).split(os.sep)[0] == 'lib' and len(rel(p).split(os.sep)) == 2]
for f in stray: bad.append(f'{f}: a source file directly in lib/ (put it in a layer folder)')
for f in files:
    src = open(f, encoding='utf-8').read()
    me = folder_of(f)
    graph[f] = []
    if me in RULES or me == 'kernels':
        if re.search(r'\bgetenv\s*\(', src):
            bad.append(f'{rel(f)}: reads the environment (getenv): pass an option instead')
    for name in INC.findall(src):
        tgt = resolve(f, name)
        if tgt is None:
            bad.append(f'{rel(f)}: includes "{name}", which is no file of the project'); continue
        graph[f].append(tgt)
        to = folder_of(tgt)
        if me in RULES:
            if '/' not in name and to != 'kernels' and os.path.dirname(tgt) != os.path.dirname(f):
                bad.append(f'{rel(f)}: includes "{name}" without its folder')
            if to != me and to not in RULES[me]:
                bad.append(f'{rel(f)}: lib/{me} may not include {rel(tgt)} ({to})')
        elif me == 'kernels' and to not in ('kernels', 'common'):
            bad.append(f'{rel(f)}: kernels/ may include only lib/common, not {rel(tgt)}')

# file-level cycles (Tarjan would be overkill: a DFS with colours)
state, stack, cycles = {}, [], []
def dfs(u):
    state[u] = 1; stack.append(u)
    for v in graph.get(u, []):
        if state.get(v) == 1:
            cycles.append(stack[stack.index(v):] + [v])
        elif not state.get(v):
            dfs(v)
    stack.pop(); state[u] = 2
sys.setrecursionlimit(10000)
for f in files:
    if not state.get(f): dfs(f)
for c in cycles: bad.append('include cycle: ' + ' -> '.join(rel(x) for x in c))

print('1..1')
if bad:
    for b in bad: print('# ' + b)
    print('not ok 1 lib/ follows its layering rule (%d violations)' % len(bad))
    sys.exit(1)
print('ok 1 lib/ follows its layering rule (%d files)' % len(files))
