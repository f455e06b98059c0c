// pybind11 entry point for spectool._native: the n-gram corpus.
//
// Input checking lives here rather than in Python so a batch of 64 windows costs a
// few type checks, not 64 numpy round trips; every bad input raises ValueError
// naming the argument, the row and the problem.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "greedy_replay.h"
#include "ngram_corpus.h"

namespace py = pybind11;
using spectool::NgramCorpus;
using spectool::TokenBatch;

namespace {

[[noreturn]] void bad(const std::string& msg) { throw py::value_error(msg); }

std::string type_name(py::handle h) { return py::str(py::type::handle_of(h).attr("__name__")); }

std::string where(const char* what, py::ssize_t i) { return std::string(what) + "[" + std::to_string(i) + "]"; }

void push_token(TokenBatch& out, long long v, const std::string& at) {
  if (v < 0) bad(at + ": token id " + std::to_string(v) + " is negative");
  if (v > std::numeric_limits<int32_t>::max()) bad(at + ": token id " + std::to_string(v) + " does not fit in int32");
  out.tokens.push_back(static_cast<int32_t>(v));
}

template <class T>
void push_row(TokenBatch& out, const T* p, py::ssize_t n, const std::string& at) {
  for (py::ssize_t j = 0; j < n; ++j) push_token(out, static_cast<long long>(p[j]), at);
  out.offsets.push_back(static_cast<int64_t>(out.tokens.size()));
}

void check_int_dtype(const py::array& a, const std::string& at) {
  char kind = a.dtype().kind();
  if (kind != 'i' || (a.itemsize() != 4 && a.itemsize() != 8))
    bad(at + ": dtype " + std::string(py::str(a.dtype())) + " is not allowed, token ids must be int32 or int64");
  if (!(a.flags() & py::array::c_style)) bad(at + ": array is not contiguous (use np.ascontiguousarray)");
}

void parse_row(TokenBatch& out, py::handle item, const std::string& at) {
  if (py::isinstance<py::array>(item)) {
    auto a = py::reinterpret_borrow<py::array>(item);
    if (a.ndim() != 1) bad(at + ": expected a 1-D token array, got " + std::to_string(a.ndim()) + " dimensions");
    check_int_dtype(a, at);
    if (a.itemsize() == 4)
      push_row(out, static_cast<const int32_t*>(a.data()), a.shape(0), at);
    else
      push_row(out, static_cast<const int64_t*>(a.data()), a.shape(0), at);
    return;
  }
  if (!py::isinstance<py::list>(item) && !py::isinstance<py::tuple>(item))
    bad(at + ": expected a list or 1-D int array of token ids, got " + type_name(item));
  auto seq = py::reinterpret_borrow<py::sequence>(item);
  for (py::ssize_t j = 0; j < static_cast<py::ssize_t>(seq.size()); ++j) {
    py::object v = seq[static_cast<size_t>(j)];
    if (py::isinstance<py::bool_>(v) || !PyIndex_Check(v.ptr()))
      bad(at + "[" + std::to_string(j) + "]: token id must be an int, got " +
          type_name(v));
    int overflow = 0;
    py::object idx = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
    long long x = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
    if (overflow) bad(at + "[" + std::to_string(j) + "]: token id does not fit in int32");
    push_token(out, x, at);
  }
  out.offsets.push_back(static_cast<int64_t>(out.tokens.size()));
}

// A list/tuple of 1-D token sequences, or a 2-D int array (one row each).
TokenBatch parse_batch(py::handle obj, const char* what, bool allow_empty_rows) {
  TokenBatch out;
  if (py::isinstance<py::array>(obj)) {
    auto a = py::reinterpret_borrow<py::array>(obj);
    if (a.ndim() != 2) bad(std::string(what) + ": expected a list of 1-D token arrays or a 2-D array");
    check_int_dtype(a, what);
    out.tokens.reserve(static_cast<size_t>(a.size()));
    for (py::ssize_t i = 0; i < a.shape(0); ++i) {
      if (a.itemsize() == 4)
        push_row(out, static_cast<const int32_t*>(a.data()) + i * a.shape(1), a.shape(1), where(what, i));
      else
        push_row(out, static_cast<const int64_t*>(a.data()) + i * a.shape(1), a.shape(1), where(what, i));
    }
  } else if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    auto seq = py::reinterpret_borrow<py::sequence>(obj);
    for (size_t i = 0; i < seq.size(); ++i) parse_row(out, seq[i], where(what, static_cast<py::ssize_t>(i)));
  } else {
    bad(std::string(what) + ": expected a list of token arrays or a 2-D int array, got " +
        type_name(obj));
  }
  if (!allow_empty_rows)
    for (int64_t i = 0; i < out.size(); ++i)
      if (out.len(i) == 0) bad(where(what, static_cast<py::ssize_t>(i)) + ": is empty");
  return out;
}

// None -> empty; otherwise n integers (list, tuple or 1-D int array); n < 0: any count.
std::vector<int64_t> parse_ints(py::handle obj, const char* what, int64_t n, bool non_negative) {
  std::vector<int64_t> out;
  if (obj.is_none()) return out;
  py::sequence seq;
  if (py::isinstance<py::array>(obj)) {
    auto a = py::reinterpret_borrow<py::array>(obj);
    if (a.ndim() != 1) bad(std::string(what) + ": expected a 1-D int array");
    if (a.dtype().kind() != 'i' && a.dtype().kind() != 'u')
      bad(std::string(what) + ": dtype " + std::string(py::str(a.dtype())) + " is not an integer type");
    seq = py::reinterpret_steal<py::sequence>(a.attr("tolist")().release());
  } else if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    seq = py::reinterpret_borrow<py::sequence>(obj);
  } else {
    bad(std::string(what) + ": expected a list of ints");
  }
  if (n >= 0 && static_cast<int64_t>(seq.size()) != n)
    bad(std::string(what) + ": has " + std::to_string(seq.size()) + " entries for " + std::to_string(n) + " rows");
  for (size_t i = 0; i < seq.size(); ++i) {
    py::object v = seq[i];
    if (py::isinstance<py::bool_>(v) || !PyIndex_Check(v.ptr()))
      bad(where(what, static_cast<py::ssize_t>(i)) + ": must be an int");
    int overflow = 0;
    py::object idx = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
    long long x = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
    if (overflow) bad(where(what, static_cast<py::ssize_t>(i)) + ": does not fit in int64");
    if (non_negative && x < 0) bad(where(what, static_cast<py::ssize_t>(i)) + ": is negative");
    out.push_back(x);
  }
  return out;
}

void check_total_lens(const TokenBatch& rows, const std::vector<int64_t>& total_lens, const char* what) {
  for (size_t i = 0; i < total_lens.size(); ++i)
    if (total_lens[i] < rows.len(static_cast<int64_t>(i)))
      bad("total_lens[" + std::to_string(i) + "] = " + std::to_string(total_lens[i]) + " is shorter than " + what +
          "[" + std::to_string(i) + "] (" + std::to_string(rows.len(static_cast<int64_t>(i))) + " tokens)");
}

NgramCorpus* make(int max_trie_depth, int min_bfs_breadth, int max_bfs_breadth, int num_draft_tokens,
                  const std::string& match, int64_t capacity) {
  if (max_trie_depth < 1) bad("max_trie_depth must be >= 1, got " + std::to_string(max_trie_depth));
  if (min_bfs_breadth < 1) bad("min_bfs_breadth must be >= 1, got " + std::to_string(min_bfs_breadth));
  if (min_bfs_breadth > max_bfs_breadth)
    bad("min_bfs_breadth (" + std::to_string(min_bfs_breadth) + ") > max_bfs_breadth (" +
        std::to_string(max_bfs_breadth) + ")");
  if (num_draft_tokens < 2) bad("num_draft_tokens must be >= 2 (root + one draft), got " + std::to_string(num_draft_tokens));
  if (match != "bfs" && match != "prob") bad("match must be 'bfs' or 'prob', got '" + match + "'");
  if (capacity < max_trie_depth)
    bad("capacity (" + std::to_string(capacity) + " nodes) is smaller than one window of max_trie_depth=" +
        std::to_string(max_trie_depth) + " nodes");
  if (capacity > std::numeric_limits<int32_t>::max() - 1) bad("capacity must be < 2**31 - 1 nodes");
  spectool::CorpusConfig c;
  c.max_trie_depth = max_trie_depth;
  c.min_bfs_breadth = min_bfs_breadth;
  c.max_bfs_breadth = max_bfs_breadth;
  c.num_draft_tokens = num_draft_tokens;
  c.match = match == "bfs" ? spectool::Match::kBfs : spectool::Match::kProb;
  c.capacity = capacity;
  return new NgramCorpus(c);
}

void batch_put(NgramCorpus& self, py::handle windows, py::handle req_ids, py::handle total_lens) {
  if (req_ids.is_none() != total_lens.is_none()) bad("req_ids and total_lens must be given together");
  TokenBatch rows = parse_batch(windows, "windows", true);
  auto ids = parse_ints(req_ids, "req_ids", rows.size(), false);
  auto totals = parse_ints(total_lens, "total_lens", rows.size(), true);
  check_total_lens(rows, totals, "windows");
  py::gil_scoped_release release;  // a small put runs here, not on the worker
  self.put(std::move(rows), std::move(ids), std::move(totals));
}

// A caller's output array: exactly this dtype and shape, C-contiguous and writeable (it is
// written in place, so a converting copy would silently lose the result).
template <typename T>
T* out_array(py::handle h, const char* name, std::initializer_list<py::ssize_t> shape) {
  if (!py::isinstance<py::array>(h)) bad(std::string("out.") + name + " must be a numpy array, got " + type_name(h));
  auto a = py::reinterpret_borrow<py::array>(h);
  if (!a.dtype().is(py::dtype::of<T>()))
    bad(std::string("out.") + name + " must have dtype " + std::string(py::str(py::dtype::of<T>())) + ", got " +
        std::string(py::str(a.dtype())));
  std::vector<py::ssize_t> want(shape);
  if (a.ndim() != static_cast<py::ssize_t>(want.size()) ||
      !std::equal(want.begin(), want.end(), a.shape()))
    bad(std::string("out.") + name + " has the wrong shape for this batch and num_draft_tokens");
  if (!(a.flags() & py::array::c_style)) bad(std::string("out.") + name + " must be C-contiguous");
  if (!a.writeable()) bad(std::string("out.") + name + " must be writeable");
  return static_cast<T*>(a.mutable_data());
}

py::tuple batch_get(NgramCorpus& self, py::handle req_ids, py::handle tails, py::handle total_lens, py::handle out) {
  if (req_ids.is_none() != total_lens.is_none()) bad("req_ids and total_lens must be given together");
  TokenBatch rows = parse_batch(tails, "tails", false);
  auto ids = parse_ints(req_ids, "req_ids", rows.size(), false);
  auto totals = parse_ints(total_lens, "total_lens", rows.size(), true);
  check_total_lens(rows, totals, "tails");
  const py::ssize_t bs = rows.size(), n = self.config().num_draft_tokens;
  py::tuple arrays;
  if (out.is_none()) {
    arrays = py::make_tuple(py::array_t<int32_t>({bs, n}), py::array_t<int32_t>({bs, n}), py::array_t<bool>({bs, n, n}),
                            py::array_t<bool>({bs, n}), py::array_t<float>({bs, n}), py::array_t<int32_t>(bs),
                            py::array_t<int32_t>(bs));
  } else {
    if (!py::isinstance<py::tuple>(out) || py::len(out) != 7)
      bad("out must be a tuple of 7 arrays (tokens, parents, mask, valid, scores, match_len, breadth)");
    arrays = py::reinterpret_borrow<py::tuple>(out);
  }
  spectool::DraftBuffers buf{out_array<int32_t>(arrays[0], "tokens", {bs, n}),
                             out_array<int32_t>(arrays[1], "parents", {bs, n}),
                             out_array<bool>(arrays[2], "mask", {bs, n, n}),
                             out_array<bool>(arrays[3], "valid", {bs, n}),
                             out_array<float>(arrays[4], "scores", {bs, n}),
                             out_array<int32_t>(arrays[5], "match_len", {bs}),
                             out_array<int32_t>(arrays[6], "breadth", {bs})};
  {
    py::gil_scoped_release release;
    self.get(rows, ids, totals, buf);
  }
  return arrays;
}

void add_external_corpus(NgramCorpus& self, const std::string& corpus_id, py::handle token_chunks, int64_t max_tokens) {
  if (corpus_id.empty()) bad("corpus_id must be a non-empty string");
  if (max_tokens < 1) bad("max_tokens must be >= 1, got " + std::to_string(max_tokens));
  for (const auto& [id, n] : self.list_external_corpora())
    if (id == corpus_id) bad("external corpus '" + corpus_id + "' already exists; remove it first");
  TokenBatch rows = parse_batch(token_chunks, "token_chunks", true);
  std::vector<std::vector<int32_t>> chunks;
  int64_t left = max_tokens;
  for (int64_t i = 0; i < rows.size() && left > 0; ++i) {
    int64_t take = std::min(left, rows.len(i));
    chunks.emplace_back(rows.data(i), rows.data(i) + take);
    left -= take;
  }
  std::unique_ptr<spectool::SuffixAutomaton> sam;
  {
    py::gil_scoped_release release;
    sam = std::make_unique<spectool::SuffixAutomaton>(chunks);
  }
  if (!self.add_external_corpus(corpus_id, std::move(sam)))
    bad("external corpus '" + corpus_id + "' already exists; remove it first");
}

template <class T>
py::array_t<T> to_array(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

py::dict replay_greedy(NgramCorpus& self, py::handle request_ids, py::handle knowns, py::handle prompt_lens,
                       py::handle ends, int max_batch_size, bool keep_trees) {
  if (max_batch_size < 1) bad("max_batch_size must be >= 1, got " + std::to_string(max_batch_size));
  TokenBatch rows = parse_batch(knowns, "knowns", false);
  auto ids = parse_ints(request_ids, "request_ids", rows.size(), false);
  auto plens = parse_ints(prompt_lens, "prompt_lens", rows.size(), true);
  auto stops = parse_ints(ends, "ends", rows.size(), true);
  std::vector<spectool::ReplayRequest> requests;
  for (int64_t i = 0; i < rows.size(); ++i) {
    const size_t at = static_cast<size_t>(i);
    if (plens[at] < 1 || stops[at] <= plens[at] || stops[at] > rows.len(i))
      bad(where("ends", i) + ": a request needs 1 <= prompt_len < end <= len(known)");
    requests.push_back({ids[at], std::vector<int32_t>(rows.data(i), rows.data(i) + rows.len(i)), plens[at],
                        stops[at]});
  }
  spectool::ReplayRows out;
  {
    py::gil_scoped_release release;
    spectool::replay_greedy(self, requests, max_batch_size, keep_trees, out);
  }
  py::dict d;
  d["iteration"] = to_array(out.iteration);
  d["request_id"] = to_array(out.request_id);
  d["seq_len"] = to_array(out.seq_len);
  d["accept_length"] = to_array(out.accept_length);
  d["censored"] = to_array(out.censored).attr("astype")("bool");
  d["match_len"] = to_array(out.match_len);
  d["batch_size"] = to_array(out.batch_size);
  d["num_nodes"] = to_array(out.num_nodes);
  if (keep_trees) {
    d["tree_tokens"] = to_array(out.tree_tokens);
    d["tree_parents"] = to_array(out.tree_parents);
    d["tree_valid"] = to_array(out.tree_valid).attr("astype")("bool");
    d["tree_offsets"] = to_array(out.tree_offsets);
  }
  return d;
}

}  // namespace

// pybind11 3 warns under -Wpedantic unless the module options are spelled out.
#if PYBIND11_VERSION_MAJOR >= 3
PYBIND11_MODULE(_native, m, py::mod_gil_used()) {
#else
PYBIND11_MODULE(_native, m) {
#endif
  m.doc() = "spectool native extension: the n-gram corpus (see spectool.native)";
  py::class_<NgramCorpus>(m, "NgramCorpus")
      .def(py::init(&make), py::arg("max_trie_depth"), py::arg("min_bfs_breadth"), py::arg("max_bfs_breadth"),
           py::arg("num_draft_tokens"), py::arg("match"), py::arg("capacity"))
      .def("batch_put", &batch_put, py::arg("windows"), py::arg("req_ids"), py::arg("total_lens"))
      .def("batch_get", &batch_get, py::arg("req_ids"), py::arg("tails"), py::arg("total_lens"),
           py::arg("out") = py::none())
      .def("synchronize", &NgramCorpus::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("erase_match_state",
           [](NgramCorpus& self, py::handle req_ids) {
             auto ids = parse_ints(req_ids, "req_ids", -1, false);
             py::gil_scoped_release release;
             self.erase_match_state(ids);
           })
      .def("replay_greedy", &replay_greedy, py::arg("request_ids"), py::arg("knowns"), py::arg("prompt_lens"),
           py::arg("ends"), py::arg("max_batch_size"), py::arg("keep_trees"))
      .def("reset", &NgramCorpus::reset, py::call_guard<py::gil_scoped_release>())
      .def("add_external_corpus", &add_external_corpus, py::arg("corpus_id"), py::arg("token_chunks"),
           py::arg("max_tokens"))
      .def("remove_external_corpus", &NgramCorpus::remove_external_corpus, py::arg("corpus_id"))
      .def("list_external_corpora", &NgramCorpus::list_external_corpora)
      .def("stats", [](NgramCorpus& self) {
        spectool::CorpusStats s = self.stats();
        py::dict d;
        d["nodes"] = s.nodes;
        d["capacity"] = s.capacity;
        d["evictions"] = s.evictions;
        d["puts"] = s.puts;
        d["gets"] = s.gets;
        d["external_corpora"] = s.external_corpora;
        d["external_tokens"] = s.external_tokens;
        d["bytes_per_node"] = s.bytes_per_node;
        return d;
      });
}
