"""Turn a workflow into the graph the server would execute, with node paths for messages.

The API form needs nothing but validation. The UI form is flattened the way the frontend's
`graphToPrompt` does it (ComfyUI frontend catalog.FRONTEND_VERSION, src/utils/executionUtil.ts and
src/lib/litegraph/src/subgraph/ExecutableNodeDTO.ts, both unchanged since 1.48.7):

- Subgraph instances (nodes whose type is the id of an entry in definitions.subgraphs, nested to any
  depth) are replaced by their inner nodes, with execution ids "outer:inner" ("140:131").
- Inside a subgraph, links from the subgraph's input node (id -10) continue at the instance's input of
  the same name: its outer link if it has one, else the instance's widget value for that input. Instance
  widget values (`widgets_values`) belong, in order, to the subgraph inputs that reach a widget inside.
  Links into the output node (id -20) carry the instance's outputs.
- Muted nodes (mode 2) produce nothing. Bypassed nodes (mode 4) hand each output the input at the same
  slot when its type matches, else the first input of that type. Neither is executed.
- Frontend-only nodes: a PrimitiveNode gives its value, a Reroute passes its input on, notes vanish.
- Widget values map to input names through the node definition (catalog.py); a link that resolves to
  nothing leaves the widget value in place, as the frontend does.

A subgraph that contains itself, directly or through others, is reported (H3404) and not expanded;
everything else that is broken (dangling links, missing nodes, slots out of range, wrong types) becomes a
finding, never an exception.
"""

from __future__ import annotations

from h3kit.workflow import catalog as catalog_mod
from h3kit.workflow.load import API, UI, Workflow
from h3kit.workflow.report import Finding

MUTED, BYPASSED = 2, 4
INPUT_NODE_ID, OUTPUT_NODE_ID = -10, -20
# Expanding subgraphs multiplies nodes; these bound the work on hostile or broken files.
MAX_NODES = 100_000
MAX_DEPTH = 32
# Longest chain of reroutes, bypassed nodes and subgraph boundaries one input may resolve through; each
# hop is two Python frames, and the default recursion limit is 1000.
MAX_HOPS = 300


# Node types whose first widget is fixed by an interface contract, whatever else a later version adds:
# MultiNPUParallelConfig's npu_count is widgets_values[0] (issue 4).
FIRST_WIDGET_CONTRACTS = {"MultiNPUParallelConfig": "npu_count"}
# Optional widgets a node type gained after workflows were saved with it, in order, at the end of its widget list:
# the frontend gives a saved list that lacks them their defaults, and so does the mapping below.
# MultiNPUParallelConfig's weights (auto, replicated, sharded; issue 14) follows npu_count.
APPENDED_WIDGETS = {"MultiNPUParallelConfig": ("weights",)}


class GraphTooLarge(Exception):
    pass


class Link:
    """A connection in the executed graph: output `slot` of node `node` (an execution id)."""

    __slots__ = ("node", "slot")

    def __init__(self, node: str, slot: int):
        self.node = node
        self.slot = slot

    def __eq__(self, other):
        return isinstance(other, Link) and other.node == self.node and other.slot == self.slot

    def __hash__(self):
        return hash((self.node, self.slot))

    def __repr__(self):
        return f"Link({self.node!r}, {self.slot})"


class Node:
    """One executed node. `inputs` maps input names to literal values or Links."""

    __slots__ = ("id", "class_type", "inputs", "path", "output_types", "ui_inputs", "widgets_mapped",
                 "title")

    def __init__(self, eid: str, class_type: str, path: str, title: str | None = None):
        self.id = eid
        self.class_type = class_type
        self.inputs: dict = {}
        self.path = path
        self.title = title
        self.output_types: list[str] | None = None
        # UI form only: [(name, type, optional, is_widget, state)] where state is "linked", "value",
        # "unlinked", "muted", "bypassed" or "broken"
        self.ui_inputs: list | None = None
        self.widgets_mapped = True

    def __repr__(self):
        return f"Node({self.id!r}, {self.class_type!r})"


class Graph:
    def __init__(self, kind: str):
        self.kind = kind
        self.nodes: dict[str, Node] = {}
        self.findings: list[Finding] = []
        self.class_types: set[str] = set()  # every node type written in the file, active or not
        self.instances: dict[str, dict] = {}  # expanded subgraph instance id -> its widget values by input name
        self.file: str | None = None  # the file it was read from, for messages
        self.model_entries: dict = {}  # the UI file's properties.models entries (h3kit.weights.sources)

    def add_finding(self, code: str, message: str, node: Node | None = None, *, node_id: str | None = None,
                    path: str | None = None):
        self.findings.append(Finding(code, message, node=node.id if node else node_id,
                                     path=node.path if node else path))


def build_graph(workflow: Workflow, catalog: catalog_mod.Catalog) -> Graph:
    if workflow.kind == API:
        return _build_api(workflow.data, catalog)
    if workflow.kind == UI:
        return _UiFlattener(workflow.data, catalog).run()
    raise ValueError(workflow.kind)


# ---------------------------------------------------------------------------------------------- API form

def _build_api(prompt: dict, catalog) -> Graph:
    graph = Graph(API)
    for raw_id, entry in prompt.items():
        eid = str(raw_id)
        path = " > ".join(eid.split(":"))
        if not isinstance(entry, dict):
            graph.add_finding("H3405", f"entry {eid!r} is {type(entry).__name__}, not a node object "
                              "{class_type, inputs}: remove it or export the prompt again", node_id=eid, path=path)
            continue
        class_type = entry.get("class_type")
        if not isinstance(class_type, str) or not class_type:
            graph.add_finding("H3405", f"node {eid} has no class_type string: give it the node type "
                              "(e.g. \"KSampler\") or remove it", node_id=eid, path=path)
            continue
        graph.class_types.add(class_type)
        inputs = entry.get("inputs", {})
        if not isinstance(inputs, dict):
            graph.add_finding("H3405", f"node {eid} ({class_type}): \"inputs\" is {type(inputs).__name__}, "
                              "not an object: export the prompt again", node_id=eid, path=path)
            inputs = {}
        meta = entry.get("_meta")
        title = meta.get("title") if isinstance(meta, dict) and isinstance(meta.get("title"), str) else None
        node = Node(eid, class_type, path, title)
        nd = catalog.get(class_type)
        node.output_types = list(nd.outputs) if nd else None
        for name, value in inputs.items():
            node.inputs[str(name)] = _api_value(value)
        graph.nodes[eid] = node
    # links to nodes that are not there, or to outputs the source does not have
    for node in graph.nodes.values():
        for name, value in node.inputs.items():
            if not isinstance(value, Link):
                continue
            src = graph.nodes.get(value.node)
            if src is None:
                graph.add_finding("H3401", f"input {name!r} is linked to node {value.node}, which is not in "
                                  "the prompt: reconnect the input or restore the node", node)
            elif src.output_types is not None and not 0 <= value.slot < len(src.output_types):
                graph.add_finding("H3401", f"input {name!r} is linked to output {value.slot} of node {src.id} "
                                  f"({src.class_type}), which has {len(src.output_types)} output(s): "
                                  "reconnect it to an existing output", node)
    return graph


def _api_value(value):
    # ["5", 0] is a link; {"__value__": [...]} wraps a literal list (the frontend's convention)
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], (str, int)) \
            and not isinstance(value[0], bool) and isinstance(value[1], int) and not isinstance(value[1], bool):
        return Link(str(value[0]), value[1])
    if isinstance(value, dict) and "__value__" in value and len(value) == 1:
        return value["__value__"]
    return value


# ----------------------------------------------------------------------------------------------- UI form

def _key(value):
    """Node and link ids appear as ints or numeric strings; compare them as one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        s = value.strip()
        if s.lstrip("-").isdigit() and len(s) < 20:
            return int(s)
        return s or None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return None


def _compatible(a, b) -> bool:
    """LiteGraph.isValidConnection: "*" and "" match anything, comma lists match on any member."""
    a = "" if a is None else str(a)
    b = "" if b is None else str(b)
    if a in ("", "*") or b in ("", "*"):
        return True
    sa = {t.strip().upper() for t in a.split(",")}
    sb = {t.strip().upper() for t in b.split(",")}
    return bool(sa & sb)


class _Level:
    """One graph: the root or a subgraph definition."""

    def __init__(self, raw: dict, graph: Graph, sid=None, label: str = ""):
        self.sid = sid
        self.label = label
        self.nodes: dict = {}
        self.links: dict = {}
        self.inputs: list = []   # subgraph definition inputs [(name, type, [link ids])]
        self.outputs: list = []
        self.input_node_id = INPUT_NODE_ID
        self.output_node_id = OUTPUT_NODE_ID
        where = f"subgraph {label!r}" if sid is not None else "the workflow"
        nodes = raw.get("nodes")
        if not isinstance(nodes, list):
            graph.add_finding("H3405", f"{where}: \"nodes\" is not a list: export the workflow again",
                              node_id=None)
            nodes = []
        for raw_node in nodes:
            if not isinstance(raw_node, dict):
                graph.add_finding("H3405", f"{where}: a node entry is {type(raw_node).__name__}, not an object: "
                                  "remove it or export the workflow again")
                continue
            nid = _key(raw_node.get("id"))
            ntype = raw_node.get("type")
            if nid is None or not isinstance(ntype, str) or not ntype:
                graph.add_finding("H3405", f"{where}: a node has no usable id or type "
                                  f"(id {raw_node.get('id')!r}, type {raw_node.get('type')!r}): "
                                  "remove it or export the workflow again")
                continue
            if nid in self.nodes:
                graph.add_finding("H3405", f"{where}: two nodes share the id {nid}: links to it are ambiguous; "
                                  "delete one copy and reconnect", node_id=str(nid))
                continue
            self.nodes[nid] = raw_node
        links = raw.get("links", [])
        if not isinstance(links, list):
            graph.add_finding("H3405", f"{where}: \"links\" is not a list: export the workflow again")
            links = []
        for raw_link in links:
            parsed = _parse_link(raw_link)
            if parsed is None:
                graph.add_finding("H3405", f"{where}: malformed link entry {str(raw_link)[:80]}: "
                                  "export the workflow again")
                continue
            self.links.setdefault(parsed[0], parsed)
        if sid is not None:
            for key, attr in (("inputNode", "input_node_id"), ("outputNode", "output_node_id")):
                io_node = raw.get(key)
                if isinstance(io_node, dict) and _key(io_node.get("id")) is not None:
                    setattr(self, attr, _key(io_node.get("id")))
            for key, target in (("inputs", self.inputs), ("outputs", self.outputs)):
                items = raw.get(key, [])
                for item in items if isinstance(items, list) else []:
                    if not isinstance(item, dict):
                        item = {}
                    ids = item.get("linkIds")
                    target.append((str(item.get("name", "")), item.get("type"),
                                   [_key(x) for x in ids] if isinstance(ids, list) else []))


def _parse_link(raw):
    """(id, origin_id, origin_slot, target_id, target_slot, type) from the list or the object form."""
    if isinstance(raw, list) and len(raw) >= 5:
        vals = raw[:6] if len(raw) >= 6 else raw[:5] + [None]
    elif isinstance(raw, dict):
        vals = [raw.get("id"), raw.get("origin_id"), raw.get("origin_slot"), raw.get("target_id"),
                raw.get("target_slot"), raw.get("type")]
    else:
        return None
    lid, oid, oslot, tid, tslot, ltype = vals
    lid, oid, tid = _key(lid), _key(oid), _key(tid)
    if lid is None or oid is None or not _is_int(oslot):
        return None
    return lid, oid, int(oslot), tid, tslot if _is_int(tslot) else None, ltype


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Dto:
    """A node of one level at one place in the expansion (ExecutableNodeDTO)."""

    __slots__ = ("raw", "level", "prefix", "instance", "eid", "mode", "type", "inputs", "outputs",
                 "sub", "expanded", "promoted", "path")

    def __init__(self, raw, level, prefix, instance, sub_level):
        self.raw = raw
        self.level = level
        self.prefix = prefix
        self.instance = instance
        nid = _key(raw.get("id"))
        self.eid = ":".join([*prefix, str(nid)])
        mode = raw.get("mode", 0)
        self.mode = mode if _is_int(mode) else 0
        self.type = raw["type"]
        inputs = raw.get("inputs")
        self.inputs = [i for i in inputs if isinstance(i, dict)] if isinstance(inputs, list) else []
        outputs = raw.get("outputs")
        self.outputs = [o if isinstance(o, dict) else {} for o in outputs] if isinstance(outputs, list) else None
        self.sub = sub_level
        self.expanded = False
        self.promoted: dict = {}
        title = raw.get("title")
        label = title if isinstance(title, str) and title else (sub_level.label if sub_level else self.type)
        own = f"{label} #{nid}"
        self.path = f"{instance.path} > {own}" if instance is not None else own

    def input_named(self, name):
        for inp in self.inputs:
            if inp.get("name") == name:
                return inp
        return None


class _Unresolved:
    """Why an input resolved to nothing: "unlinked", "muted", "bypassed" or "broken"."""

    __slots__ = ("state", "detail")

    def __init__(self, state, detail=""):
        self.state = state
        self.detail = detail


class _Recursion(Exception):
    pass


class _UiFlattener:
    def __init__(self, doc: dict, catalog):
        self.doc = doc
        self.catalog = catalog
        self.graph = Graph(UI)
        self.dtos: dict[str, _Dto] = {}
        self.broken_reported: set = set()

    # -- levels and subgraph definitions
    def run(self) -> Graph:
        graph = self.graph
        self.subgraphs: dict = {}
        definitions = self.doc.get("definitions")
        raw_subs = definitions.get("subgraphs", []) if isinstance(definitions, dict) else []
        for raw_sub in raw_subs if isinstance(raw_subs, list) else []:
            if not isinstance(raw_sub, dict) or not isinstance(raw_sub.get("id"), str):
                graph.add_finding("H3405", "a subgraph definition has no id string: export the workflow again")
                continue
            name = raw_sub.get("name") if isinstance(raw_sub.get("name"), str) else raw_sub["id"]
            self.subgraphs.setdefault(raw_sub["id"], _Level(raw_sub, graph, raw_sub["id"], name))
        self.cyclic = self._self_containing()
        root = _Level(self.doc, graph)
        self._expand(root, [], None, 0)
        for level in [root, *self.subgraphs.values()]:
            for raw in level.nodes.values():
                if raw["type"] not in self.subgraphs:
                    graph.class_types.add(raw["type"])
        for dto in list(self.dtos.values()):
            if dto.mode in (MUTED, BYPASSED) or dto.sub is not None or dto.type in catalog_mod.VIRTUAL_NODES:
                continue
            if dto.type in ("GetNode", "SetNode"):
                continue
            if dto.instance is not None and not dto.instance.expanded:
                continue
            self._emit(dto)
        return graph

    def _self_containing(self) -> set:
        """Ids of subgraphs that contain themselves through any chain of instances (each reported once)."""
        children = {sid: {raw["type"] for raw in lvl.nodes.values() if raw["type"] in self.subgraphs}
                    for sid, lvl in self.subgraphs.items()}
        cyclic: set = set()
        # iterative DFS with colours: grey on the stack, black done
        colour = dict.fromkeys(children, 0)
        for start in children:
            if colour[start]:
                continue
            stack = [(start, iter(sorted(children[start])))]
            colour[start] = 1
            path = [start]
            while stack:
                sid, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    colour[sid] = 2
                    stack.pop()
                    path.pop()
                    continue
                if colour[nxt] == 1:
                    loop = path[path.index(nxt):]
                    if not cyclic.issuperset(loop):
                        names = " > ".join(self.subgraphs[s].label for s in [*loop, nxt])
                        self.graph.add_finding(
                            "H3404", f"subgraph {self.subgraphs[nxt].label!r} contains itself ({names}): "
                            "ComfyUI cannot expand it; replace the inner instance with the nodes it should run",
                            node_id=None, path=names)
                    cyclic.update(loop)
                elif colour[nxt] == 0:
                    colour[nxt] = 1
                    path.append(nxt)
                    stack.append((nxt, iter(sorted(children[nxt]))))
        # anything that contains a cyclic subgraph cannot be expanded fully either
        changed = True
        while changed:
            changed = False
            for sid, kids in children.items():
                if sid not in cyclic and kids & cyclic:
                    cyclic.add(sid)
                    changed = True
        return cyclic

    def _expand(self, level: _Level, prefix: list, instance, depth: int):
        for nid, raw in level.nodes.items():
            sub = self.subgraphs.get(raw["type"])
            dto = _Dto(raw, level, prefix, instance, sub)
            if len(self.dtos) >= MAX_NODES:
                raise GraphTooLarge(f"the workflow expands to more than {MAX_NODES} nodes")
            self.dtos[dto.eid] = dto
            if sub is None or dto.mode in (MUTED, BYPASSED):
                continue
            if sub.sid in self.cyclic:
                continue  # reported once per definition in _self_containing
            if depth + 1 > MAX_DEPTH:
                raise GraphTooLarge(f"subgraphs are nested more than {MAX_DEPTH} deep")
            dto.promoted = self._promoted_values(dto, sub)
            self.graph.instances[dto.eid] = dto.promoted
            dto.expanded = True
            self._expand(sub, [*prefix, str(nid)], dto, depth + 1)

    def _promoted_values(self, dto: _Dto, sub: _Level) -> dict:
        """Instance widget values by subgraph input name (SubgraphNode._applyPromotedWidgetValues)."""
        values = dto.raw.get("widgets_values")
        if not isinstance(values, list):
            return {}
        names = [name for name, _t, link_ids in sub.inputs if self._reaches_widget(sub, link_ids, set())]
        return {name: values[i] for i, name in enumerate(names) if i < len(values)}

    def _reaches_widget(self, sub: _Level, link_ids, seen) -> bool:
        if len(seen) > MAX_DEPTH:
            return False
        for lid in link_ids:
            link = sub.links.get(lid)
            if link is None:
                continue
            target = sub.nodes.get(link[3])
            if target is None:
                continue
            for inp in target.get("inputs") or []:
                if not isinstance(inp, dict) or _key(inp.get("link")) != lid:
                    continue
                if isinstance(inp.get("widget"), dict):
                    return True
                inner = self.subgraphs.get(target["type"])
                if inner is not None and inner.sid not in seen and inner.sid not in self.cyclic:
                    for name, _t, inner_ids in inner.inputs:
                        if name == inp.get("name") and self._reaches_widget(inner, inner_ids, seen | {inner.sid}):
                            return True
        return False

    # -- per-node output
    def _emit(self, dto: _Dto):
        node = Node(dto.eid, dto.type, dto.path, dto.raw.get("title") if isinstance(dto.raw.get("title"), str)
                    else None)
        node.output_types = [str(o.get("type", "")) for o in dto.outputs] if dto.outputs is not None else None
        nd = self.catalog.get(dto.type)
        if node.output_types is None and nd is not None:
            node.output_types = list(nd.outputs)
        self._widget_values(dto, node, nd)
        node.ui_inputs = []
        for index, inp in enumerate(dto.inputs):
            name = inp.get("name")
            if not isinstance(name, str):
                self.graph.add_finding("H3405", f"input {index} has no name: export the workflow again", node)
                continue
            optional = inp.get("shape") == 7
            is_widget = isinstance(inp.get("widget"), dict)
            try:
                result = self._resolve_input(dto, inp, set())
            except _Recursion:
                result = _Unresolved("broken", "cycle")
                self._report_broken(node, f"input {name!r} resolves through a loop of links (reroutes, "
                                    "bypassed nodes or subgraph boundaries): break the loop", "H3403")
            if isinstance(result, _Unresolved):
                state = result.state
                if state == "broken" and result.detail and result.detail != "cycle":
                    self._report_broken(node, f"input {name!r}: {result.detail}")
            elif isinstance(result, Link):
                node.inputs[name] = result
                state = "linked"
            else:
                node.inputs[name] = result[1]
                state = "value"
            node.ui_inputs.append((name, inp.get("type"), optional, is_widget, state,
                                   result.detail if isinstance(result, _Unresolved) else ""))
        self.graph.nodes[node.id] = node

    def _report_broken(self, node: Node, message: str, code: str = "H3401"):
        key = (node.id, message)
        if key not in self.broken_reported:
            self.broken_reported.add(key)
            self.graph.add_finding(code, message, node)

    def _widget_values(self, dto: _Dto, node: Node, nd):
        values = dto.raw.get("widgets_values")
        if isinstance(values, dict):  # some custom nodes save widgets by name
            node.inputs.update({str(k): v for k, v in values.items()})
            return
        if not isinstance(values, list) or nd is None:
            node.widgets_mapped = nd is None or not nd.widget_slots() or values is None
            return
        slots = nd.widget_slots()
        appended = APPENDED_WIDGETS.get(dto.type, ())
        missing = len(slots) - len(values)
        if nd.widget_slots_complete and 0 < missing <= len(appended) and tuple(slots[-missing:]) == appended[-missing:]:
            slots = slots[:len(values)]  # saved before those widgets existed: they keep their defaults
        # Saved by another ComfyUI version, positions would be guessed: map nothing. When the definition
        # has a widget this module does not model, the positions before it are still exact.
        fits = len(slots) == len(values) if nd.widget_slots_complete else len(values) >= len(slots)
        if not fits:
            node.widgets_mapped = False
            if dto.type in FIRST_WIDGET_CONTRACTS and values:
                node.inputs[FIRST_WIDGET_CONTRACTS[dto.type]] = values[0]
            return
        for name, value in zip(slots, values):
            if name is not None:
                node.inputs[name] = value

    # -- link resolution (ExecutableNodeDTO.resolveInput / resolveOutput)
    def _resolve_input(self, dto: _Dto, inp: dict, visited: set):
        key = (dto.eid, "I", inp.get("name"))
        if key in visited:
            raise _Recursion()
        if len(visited) > 2 * MAX_HOPS:
            return _Unresolved("broken", f"the link chain is longer than {MAX_HOPS} hops (reroutes, bypassed "
                               "nodes, subgraph boundaries); shorten it")
        visited.add(key)
        raw_link = inp.get("link")
        if raw_link is None:
            return _Unresolved("unlinked")
        lid = _key(raw_link)
        link = dto.level.links.get(lid)
        if link is None:
            return _Unresolved("broken", f"link {raw_link!r} is not in the workflow's link table; "
                               "reconnect the input")
        origin_id, origin_slot = link[1], link[2]
        if dto.instance is not None and origin_id == dto.level.input_node_id:
            level = dto.level
            if not 0 <= origin_slot < len(level.inputs):
                return _Unresolved("broken", f"link {lid} comes from subgraph input {origin_slot}, which "
                                   f"{level.label!r} does not have; reconnect it")
            name = level.inputs[origin_slot][0]
            inst = dto.instance
            outer = inst.input_named(name)
            if outer is not None and outer.get("link") is not None:
                return self._resolve_input(inst, outer, visited)
            if name in inst.promoted:
                return ("value", inst.promoted[name])
            return _Unresolved("unlinked", f"subgraph input {name!r} of {inst.path}")
        origin_raw = dto.level.nodes.get(origin_id)
        if origin_raw is None:
            return _Unresolved("broken", f"link {lid} comes from node {origin_id}, which is not in "
                               f"{'subgraph ' + repr(dto.level.label) if dto.level.sid else 'the workflow'}; "
                               "reconnect the input")
        origin = self.dtos.get(":".join([*dto.prefix, str(origin_id)]))
        if origin is None:
            return _Unresolved("broken", f"node {origin_id} could not be expanded")
        return self._resolve_output(origin, origin_slot, inp.get("type"), visited)

    def _resolve_output(self, dto: _Dto, slot: int, want_type, visited: set):
        key = (dto.eid, "O", slot)
        if key in visited:
            raise _Recursion()
        visited.add(key)
        if dto.mode == MUTED:
            return _Unresolved("muted", f"node {dto.path} is muted")
        if dto.mode == BYPASSED:
            index = self._bypass_index(dto, slot, want_type)
            if index < 0:
                return _Unresolved("bypassed", f"bypassed node {dto.path} has no input of type {want_type} "
                                   "to pass through")
            return self._resolve_input(dto, dto.inputs[index], visited)
        if dto.sub is not None:
            return self._resolve_subgraph_output(dto, slot, want_type, visited)
        if dto.type == "PrimitiveNode":
            values = dto.raw.get("widgets_values")
            if isinstance(values, list) and values:
                return ("value", values[0])
            return _Unresolved("unlinked", f"primitive {dto.path} has no value")
        if dto.type == "Reroute":
            if not dto.inputs:
                return _Unresolved("unlinked", f"reroute {dto.path} has no input")
            return self._resolve_input(dto, dto.inputs[0], visited)
        if dto.type == "GetNode":  # KJNodes Set/Get pair: a named wire within one graph level
            return self._resolve_get_node(dto, visited)
        if dto.type in catalog_mod.VIRTUAL_NODES:
            return _Unresolved("unlinked", f"{dto.type} {dto.path} has no output")
        if dto.outputs is not None and not 0 <= slot < len(dto.outputs):
            return _Unresolved("broken", f"linked to output {slot} of node {dto.path}, which has "
                               f"{len(dto.outputs)} output(s); reconnect it")
        return Link(dto.eid, slot)

    def _bypass_index(self, dto: _Dto, slot: int, want_type) -> int:
        inputs = dto.inputs
        out_type = None
        if dto.outputs is not None and 0 <= slot < len(dto.outputs):
            out_type = dto.outputs[slot].get("type")
        if want_type in ("*", "", None):
            return slot if len(inputs) > slot else (0 if inputs else -1)
        if slot < len(inputs) and _compatible(inputs[slot].get("type"), out_type) \
                and _compatible(inputs[slot].get("type"), want_type):
            return slot
        for i, inp in enumerate(inputs):
            if inp.get("type") == want_type:
                return i
        for i, inp in enumerate(inputs):
            if _compatible(inp.get("type"), out_type) and _compatible(inp.get("type"), want_type):
                return i
        return -1

    def _resolve_subgraph_output(self, dto: _Dto, slot: int, want_type, visited: set):
        sub = dto.sub
        if not dto.expanded:  # a self-containing subgraph, already reported as H3404
            return _Unresolved("broken")
        if not 0 <= slot < len(sub.outputs):
            return _Unresolved("broken", f"linked to output {slot} of subgraph {sub.label!r}, which has "
                               f"{len(sub.outputs)} output(s); reconnect it")
        link_ids = sub.outputs[slot][2]
        if link_ids and all(sub.links.get(lid) is None for lid in link_ids):
            return _Unresolved("broken", f"output {slot} of subgraph {sub.label!r} refers to link(s) "
                               f"{', '.join(map(str, link_ids))}, which the subgraph does not have; "
                               "reconnect the output inside the subgraph")
        for lid in link_ids:
            link = sub.links.get(lid)
            if link is None:
                continue
            origin_id, origin_slot = link[1], link[2]
            if origin_id == sub.input_node_id:  # a subgraph input wired straight to an output
                if not 0 <= origin_slot < len(sub.inputs):
                    break
                outer = dto.input_named(sub.inputs[origin_slot][0])
                if outer is not None and outer.get("link") is not None:
                    return self._resolve_input(dto, outer, visited)
                name = sub.inputs[origin_slot][0]
                if name in dto.promoted:
                    return ("value", dto.promoted[name])
                return _Unresolved("unlinked")
            inner = self.dtos.get(":".join([*dto.prefix, str(_key(dto.raw.get("id"))), str(origin_id)]))
            if inner is None:
                return _Unresolved("broken", f"subgraph {sub.label!r} output {slot} comes from node "
                                   f"{origin_id}, which is not in the subgraph; reconnect it")
            return self._resolve_output(inner, origin_slot, want_type, visited)
        return _Unresolved("unlinked", f"subgraph {sub.label!r} output {slot} is not connected inside")

    def _resolve_get_node(self, dto: _Dto, visited: set):
        values = dto.raw.get("widgets_values")
        name = values[0] if isinstance(values, list) and values else None
        for raw in dto.level.nodes.values():
            if raw.get("type") != "SetNode":
                continue
            set_values = raw.get("widgets_values")
            if isinstance(set_values, list) and set_values and set_values[0] == name:
                setter = self.dtos.get(":".join([*dto.prefix, str(_key(raw.get("id")))]))
                if setter is not None and setter.inputs:
                    return self._resolve_input(setter, setter.inputs[0], visited)
        return _Unresolved("unlinked", f"GetNode {dto.path} names no SetNode {name!r}")
