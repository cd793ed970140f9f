"""What a ComfyUI user sees: open every example workflow in the real ComfyUI frontend (headless
Chromium driven by Playwright) and fail where the graph looks broken.

    python -m tome_lab.comfy_browser_check http://127.0.0.1:8188 OUT_DIR [--chromium PATH]

Needs a running ComfyUI with this pack in ``custom_nodes/`` (the harness's
``setup_and_launch.sh``), Playwright (``pip install playwright``; its own browsers are not
needed) and a Chromium (Debian's ``chromium`` package: ``/usr/bin/chromium``). For each
``example_workflows/*.json`` it calls ``app.loadGraphData`` in the default (classic) canvas and
checks that no two node boxes overlap (title bar included), that the ToMe node shows the preset
and its front inputs with the advanced ones folded, and that every widget it shows lies inside
it; it saves ``<workflow>.png``. Then the node alone (folded and unfolded), a chosen preset
filling the inputs, a saved node keeping its 21 widget values, a graph saved before the folding
opening folded, and the same workflows in
Nodes 2.0 (DOM boxes, ``nodes2-<workflow>.png``). One line per check; exit status 1 if any
failed. The lab's tool, not shipped with the pack.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / "example_workflows"
NODE = "ToMeTokenMerging"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
VIEW = {"width": 1800, "height": 1000}

# Runs in the page: every node's box as LiteGraph draws it ([x, y, w, h], title bar included:
# LGraphNode.boundingRect), and for the ToMe node its widgets (shown or folded, y, height).
BOXES = """() => {
  const app = window.app ?? window.comfyAPI?.app?.app;
  const nodes = app.graph._nodes ?? app.graph.nodes;
  return nodes.map((n) => {
    n.updateArea?.();
    const r = n.boundingRect ?? [n.pos[0], n.pos[1] - 30, n.size[0], n.size[1] + 30];
    const widgets = (n.widgets ?? []).map((w) => ({
      name: w.name, shown: n.isWidgetVisible ? n.isWidgetVisible(w) : true,
      y: w.last_y ?? w.y ?? null,
      h: w.computedHeight ?? (w.computeSize ? w.computeSize(n.size[0])[1] : 20)}));
    return {id: n.id, type: n.type, box: Array.from(r), size: Array.from(n.size),
            widgets};
  });
}"""

LOAD = """async (wf) => {
  const app = window.app ?? window.comfyAPI?.app?.app;
  await app.loadGraphData(wf);
  app.canvas.setDirty(true, true);
  app.canvas.draw(true, true);
}"""


def overlaps(boxes: list[dict]) -> list[str]:
    out = []
    for i, a in enumerate(boxes):
        ax, ay, aw, ah = a["box"]
        for b in boxes[i + 1:]:
            bx, by, bw, bh = b["box"]
            if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
                out.append(f"{a['type']} #{a['id']} overlaps {b['type']} #{b['id']}")
    return out


def ours_inside(boxes: list[dict], folded: bool = True) -> list[str]:
    """The ToMe node's shown widgets inside its body; folded, the preset and the front inputs
    first."""
    out = []
    for node in boxes:
        if node["type"] != NODE:
            continue
        shown = [w for w in node["widgets"] if w["shown"]]
        for w in shown:
            if w["y"] is None or w["y"] < 0 or w["y"] + w["h"] > node["size"][1]:
                out.append(f"{NODE} #{node['id']}: widget {w['name']} outside the node "
                           f"(y {w['y']}, height {w['h']}, node {node['size'][1]:.0f} high)")
        names = [w["name"] for w in shown]
        if folded and names[:5] != ["preset", "method", "ratio", "downsample_factor", "policy"]:
            out.append(f"{NODE} #{node['id']}: shows {names}")
    return out


class Checker:
    def __init__(self, page, out: Path):
        self.page, self.out, self.failed = page, out, False

    def say(self, ok: bool, what: str, problems: list[str] = ()) -> None:
        self.failed |= not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what}" + (": " + "; ".join(problems)
                                                      if problems else ""), flush=True)

    def load(self, workflow: dict) -> None:
        """Load ``workflow``; again if the page then shows another graph (the frontend opens
        its default graph while it starts)."""
        want = sorted(n["type"] for n in workflow["nodes"])
        for _ in range(3):
            self.page.evaluate(LOAD, workflow)
            self.page.wait_for_timeout(1500)
            if sorted(b["type"] for b in self.page.evaluate(BOXES)) == want:
                return
        self.say(False, f"the page did not keep the workflow's {len(want)} nodes")

    def classic(self, path: Path) -> None:
        self.load(json.loads(path.read_text()))
        boxes = self.page.evaluate(BOXES)
        problems = overlaps(boxes) + ours_inside(boxes)
        self.shoot(f"{path.stem}.png")
        self.say(not problems, f"classic canvas: {path.name} ({len(boxes)} nodes)", problems)

    def shoot(self, name: str, clip: dict | None = None) -> None:
        """A screenshot without the missing-models toast (the harness has random weights under
        other names; a user with the models never sees it)."""
        self.page.evaluate("""() => document.querySelectorAll('.p-toast, [role="alert"]')
                              .forEach((e) => e.remove())""")
        self.page.screenshot(path=str(self.out / name), clip=clip)

    def alone(self, name: str, unfold: bool = False) -> dict:
        """The node alone on an empty canvas at 150 %, screenshot clipped to it."""
        got = self.page.evaluate("""async ([type, unfold]) => {
          const app = window.app ?? window.comfyAPI?.app?.app;
          app.graph.clear();
          const node = LiteGraph.createNode(type);
          node.pos = [80, 100];
          app.graph.add(node);
          if (unfold) node.widgets.find((w) => w.name === "tome_advanced").callback();
          app.canvas.ds.scale = 1.5; app.canvas.ds.offset = [0, 0];
          app.canvas.setDirty(true, true); app.canvas.draw(true, true);
          const shown = node.widgets.filter((w) => node.isWidgetVisible(w)).map((w) => w.name);
          return {shown, size: Array.from(node.size)};
        }""", [NODE, unfold])
        self.page.wait_for_timeout(1000)
        w, h = got["size"]
        rects = self.page.evaluate("""() => Array.from(document.querySelectorAll(
            '[data-node-id]')).map((e) => { const r = e.getBoundingClientRect();
            return [r.x, r.y, r.width, r.height]; })""")
        if rects:  # Nodes 2.0: the node's own box on screen
            x, y, rw, rh = rects[0]
            clip = {"x": x - 30, "y": y - 30, "width": rw + 60, "height": rh + 60}
        else:
            clip = {"x": 90, "y": 80, "width": (w + 40) * 1.5, "height": (h + 60) * 1.5}
        self.shoot(name, clip)
        return got

    def node_alone(self) -> None:
        got = self.alone("node.png")
        w, h = got["size"]
        self.say(len(got["shown"]) == 6, f"the node alone shows {got['shown']}, {w:.0f}x{h:.0f}")
        opened = self.alone("node-advanced.png", unfold=True)
        w, h = opened["size"]
        self.say(len(opened["shown"]) == 22, f"the button unfolds {len(opened['shown'])} widgets, "
                 f"{w:.0f}x{h:.0f}")
        boxes = self.page.evaluate(BOXES)
        problems = ours_inside(boxes, folded=False)
        self.say(not problems, "unfolded, every widget inside the node", problems)

    def preset_fills(self) -> None:
        got = self.page.evaluate("""async () => {
          const app = window.app ?? window.comfyAPI?.app?.app;
          const node = (app.graph._nodes ?? app.graph.nodes)[0];
          const w = (name) => node.widgets.find((x) => x.name === name);
          w("preset").value = "fast"; w("preset").callback("fast");
          const fast = {f: w("downsample_factor").value, m: w("method").value,
                        s: w("schedule").value, r: w("reuse").value};
          w("ratio").value = 0.3;  // a user's change after the preset
          const saved = node.serialize().widgets_values;
          w("preset").value = "recommended"; w("preset").callback("recommended");
          return {fast, saved, back: w("method").value};
        }""")
        fast = got["fast"]
        ok = (fast == {"f": 4, "m": "downsample", "s": "all:8", "r": 10}
              and got["back"] == "merge")
        self.say(ok, f"choosing preset fast fills the inputs ({fast}), recommended resets them "
                 f"(method {got['back']})")
        saved = got["saved"]
        ok = len(saved) == 21 and saved[0] == "fast" and saved[2] == 0.3
        self.say(ok, f"a saved node keeps its 21 widget values in order ({len(saved)} saved)")

    def old_graph(self, path: Path) -> None:
        """A graph saved before the folding (the node as high as its 21 inputs) opens folded,
        at the folded height, its values kept."""
        workflow = json.loads(path.read_text())
        (node,) = [n for n in workflow["nodes"] if n["type"] == NODE]
        node["size"] = [node["size"][0], 538]
        self.load(workflow)
        ours = [b for b in self.page.evaluate(BOXES) if b["type"] == NODE][0]
        shown = sum(w["shown"] for w in ours["widgets"])
        saved = self.page.evaluate("""(type) => {
          const app = window.app ?? window.comfyAPI?.app?.app;
          const n = (app.graph._nodes ?? app.graph.nodes).find((n) => n.type === type);
          return n.serialize().widgets_values; }""", NODE)
        ok = shown == 6 and ours["size"][1] == 178 and saved == node["widgets_values"]
        self.say(ok, f"a graph saved before the folding opens folded: {shown} widgets, "
                 f"{ours['size'][1]:.0f} px high, values kept: {saved == node['widgets_values']}")

    def nodes2(self, path: Path) -> None:
        self.load(json.loads(path.read_text()))
        rects = self.page.evaluate("""() => Array.from(
            document.querySelectorAll('[data-node-id]')).map((e) => {
              const r = e.getBoundingClientRect();
              return {id: e.getAttribute('data-node-id'), type: e.innerText.split('\\n')[0],
                      box: [r.x, r.y, r.width, r.height]};
            }).filter((n) => n.box[2] > 0)""")
        problems = overlaps(rects) if rects else ["no Nodes 2.0 node in the page"]
        self.shoot(f"nodes2-{path.stem}.png")
        ours = [f"{r['box'][2]:.0f}x{r['box'][3]:.0f} px on screen" for r in rects
                if r["type"].startswith("ToMe")]
        self.say(not problems, f"Nodes 2.0: {path.name} ({len(rects)} nodes; ToMe "
                 f"{', '.join(ours)})", problems)


def vue_nodes(page, on: bool) -> None:
    page.evaluate("""async (on) => {
      const app = window.app ?? window.comfyAPI?.app?.app;
      await app.extensionManager.setting.set("Comfy.VueNodes.Enabled", on);
    }""", on)
    page.wait_for_timeout(1500)
    page.keyboard.press("Escape")  # frontend 1.35 opens its template browser on the switch
    page.wait_for_timeout(500)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="a running ComfyUI, e.g. http://127.0.0.1:8188")
    parser.add_argument("out", type=Path, help="folder for the screenshots")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--no-nodes2", action="store_true", help="skip the Nodes 2.0 view")
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    paths = sorted(WORKFLOWS.glob("*.json"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, headless=True, args=FLAGS)
        page = browser.new_page(viewport=VIEW)
        page.goto(args.url)
        page.wait_for_function(
            "() => (window.app ?? window.comfyAPI?.app?.app)?.graph && window.LiteGraph",
            timeout=120_000)
        page.wait_for_timeout(5000)  # the default graph it opens first
        version = page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__ ?? 'unknown'")
        print(f"ComfyUI frontend {version} at {args.url}", flush=True)
        check = Checker(page, args.out)
        vue_nodes(page, False)
        for path in paths:
            check.classic(path)
        check.node_alone()
        check.preset_fills()
        check.old_graph(WORKFLOWS / "sd15_tome.json")
        if not args.no_nodes2:
            vue_nodes(page, True)
            for path in paths:
                check.nodes2(path)
            check.alone("nodes2-node.png")
            vue_nodes(page, False)
        browser.close()
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
