# After / before median per row of an interleaved A/B (ab.sh output): python ratios.py ab.txt
import sys, re, collections
cur=None; d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    m=re.match(r'## (\S+), round (\d), 2x(\d), (before|after)', l)
    if m: cur=m.groups(); continue
    v=l.split()
    if cur and len(v)>7 and v[0]=='schemoe':
        d[(cur[0],cur[2],v[1],cur[1])].append((cur[3],float(v[6])))
for k in sorted(d):
    x=dict(d[k]); print('%s 2x%s r=%s round %s: before %.1f ms, after %.1f ms, after/before %.3f'%(*k,x['before'],x['after'],x['after']/x['before']))
