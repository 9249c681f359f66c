import re, sys
sys.path.insert(0, ".")
from nfjax.config import CacheConfig, ScheduleConfig, SchedulerConfig, StrategyConfig
from nfjax.engine.runner import Runner
from nfjax.models.random_init import SHAPES, random_model
from nfjax.parallel import make_mesh, shard_model
cfg = SHAPES[sys.argv[1]].replace(num_layers=1)
b = int(sys.argv[2])
mesh = make_mesh(1); model = random_model(cfg); shard_model(model, mesh)
sc = ScheduleConfig(strategies=(StrategyConfig("nanoflow", plan=sys.argv[3]),), streams=True)
r = Runner(model, CacheConfig(16, 512, 64), SchedulerConfig((b,), max_seqs=64), mesh, sc)
r.compile_all()
for k, exe in r._steps.items():
    t = exe.as_text()
    starts = [l for l in t.splitlines() if "call-start(" in l or "async-start(" in l]
    print(k, "call-start:", t.count("call-start("), "annot:", len(re.findall(r"_xla_stream_annotation", t)),
          "async-start:", t.count("async-start("))
    for l in starts[:6]:
        print("   ", l.strip()[:220])
# schedule: what runs between each call-start and its call-done (the text is in schedule order)
for k, exe in r._steps.items():
    lines = exe.as_text().splitlines()
    entry = next(i for i, l in enumerate(lines) if l.startswith("ENTRY"))
    body = [l.strip() for l in lines[entry:]]
    for i, l in enumerate(body):
        m = re.match(r"%(call-start(\.\d+)?) = ", l)
        if m:
            name = m.group(1)
            j = next(j for j, x in enumerate(body) if f"call-done(" in x and f"%{name})" in x or f"%{name}," in x and "call-done(" in x)
            between = [re.match(r"%?([\w.\-]+)", x).group(1) for x in body[i + 1:j]]
            heavy = [x for x in between if x.startswith(("fusion", "custom-call", "cublas", "gemm", "call-start", "loop", "input"))]
            print(k, name, "at", i, "done at", j, "ops between:", len(between), "heavy:", heavy[:12])
