/* The op fuser's hot path, compiled: the unchanged-plan check and the call into
 * the published plan, with no Python frame in between.
 *
 * This is the guard of te_fuser/ops/guard.py, in C: that module states the
 * conditions a call must meet to hit (in the order they are checked here), what
 * the guard reads (guard.Reads, this type's constructor arguments) and what an
 * armed decision holds (guard.Decision, arm's argument); guard.ReferenceGuard is
 * the same guard in Python, and tests/test_hot_guard.py runs one table of
 * conditions through both. A Guard belongs to one OperationFuser, whose Python
 * path decides which plan runs (building one when needed) and then arms the
 * guard with that decision. guard(x, training) checks the conditions, reading
 * the same state in the same way as the Python path; on a hit it counts one (in
 * a C counter the fuser takes into its statistics when they are read) and calls
 * the plan. Anything else, and any input it does not handle (not a tensor), goes
 * to the Python path (`miss`), which decides afresh and re-arms. A hit is
 * therefore always a case the Python path would also have called a hit with the
 * same plan.
 *
 * READS_FIELDS and DECISION_FIELDS below list guard.py's Reads and Decision
 * fields in their order; the module exports them (READS, DECISION) and
 * hot_guard.py loads it only when they match.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

#ifndef Py_ALWAYS_INLINE /* Python < 3.11 */
#define Py_ALWAYS_INLINE
#endif

/* guard.Reads, in its order (what each field is: see guard.py); fixed at construction */
#define READS_FIELDS(X) X(miss) X(stack) X(epoch) X(grad_enabled) X(any_autocast) X(compute_dtype) X(tensor_type) \
    X(hook_dicts)
/* guard.Decision, in its order: the armed decision. training, needs_backward and is_cuda are Py_True or
 * Py_False, params a tuple; every field NULL: disarmed */
#define DECISION_FIELDS(X) X(state) X(training) X(needs_backward) X(params) X(dtype) X(is_cuda) X(in_shape) \
    X(epoch) X(apply) X(plan_arg)

#define DECLARE(f) PyObject *f;
#define INDEX(f) I_##f,
enum { DECISION_FIELDS(INDEX) N_DECISION };
#undef INDEX

typedef struct {
    READS_FIELDS(DECLARE)
} Reads;

typedef struct {
    DECISION_FIELDS(DECLARE)
} Decision;
#undef DECLARE

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Reads r;
    Decision d;
    long long hits; /* hits since the fuser last took them (take_hits) */
} Guard;

static PyObject *str_requires_grad, *str_dtype, *str_is_cuda, *str_shape;

static void disarm(Guard *g) {
#define CLEAR(f) Py_CLEAR(g->d.f);
    DECISION_FIELDS(CLEAR)
#undef CLEAR
}

/* 1 if `obj.requires_grad` is True, 0 if not, -1 on error. */
static int requires_grad(PyObject *obj) {
    PyObject *v = PyObject_GetAttr(obj, str_requires_grad);
    if (v == NULL) return -1;
    int r = (v == Py_True);
    Py_DECREF(v);
    return r;
}

/* 1 if every hook dict is empty. */
static int no_hooks(Guard *g) {
    Py_ssize_t n = PyTuple_GET_SIZE(g->r.hook_dicts);
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyDict_GET_SIZE(PyTuple_GET_ITEM(g->r.hook_dicts, i)) != 0) return 0;
    return 1;
}

/* 1: the armed plan applies to this call; 0: it does not; -1: error. The
 * numbers are guard.py's conditions. Inlined into the call (as well as into
 * guard.matches): a call of its own costs the hot path measurably. */
static inline Py_ALWAYS_INLINE int matches(Guard *g, PyObject *x, PyObject *training) {
    const Decision *d = &g->d;
    if (d->state == NULL || training != d->training || !PyObject_TypeCheck(x, (PyTypeObject *)g->r.tensor_type))
        return 0; /* 1, 2 */
    Py_ssize_t depth = PyList_GET_SIZE(g->r.stack);
    if (depth == 0 || PyList_GET_ITEM(g->r.stack, depth - 1) != d->state) return 0; /* 3 */
    if (!no_hooks(g)) return 0;                                                     /* 4 */

    PyObject *grad = PyObject_CallNoArgs(g->r.grad_enabled); /* 5 */
    if (grad == NULL) return -1;
    int needs_backward = (grad == Py_True);
    Py_DECREF(grad);
    if (needs_backward) {
        int r = requires_grad(x);
        if (r < 0) return -1;
        Py_ssize_t n = PyTuple_GET_SIZE(d->params);
        for (Py_ssize_t i = 0; !r && i < n; i++) {
            r = requires_grad(PyTuple_GET_ITEM(d->params, i));
            if (r < 0) return -1;
        }
        needs_backward = r;
    }
    if ((needs_backward ? Py_True : Py_False) != d->needs_backward) return 0;

    PyObject *autocast = PyObject_CallNoArgs(g->r.any_autocast); /* 6 */
    if (autocast == NULL) return -1;
    PyObject *dtype =
        (autocast == Py_True) ? PyObject_CallOneArg(g->r.compute_dtype, x) : PyObject_GetAttr(x, str_dtype);
    Py_DECREF(autocast);
    if (dtype == NULL) return -1;
    int same = (dtype == d->dtype);
    Py_DECREF(dtype);
    if (!same) return 0;

    PyObject *is_cuda = PyObject_GetAttr(x, str_is_cuda); /* 7 */
    if (is_cuda == NULL) return -1;
    same = (is_cuda == d->is_cuda);
    Py_DECREF(is_cuda);
    if (!same) return 0;

    PyObject *shape = PyObject_GetAttr(x, str_shape); /* 8 */
    if (shape == NULL) return -1;
    same = PyObject_RichCompareBool(shape, d->in_shape, Py_EQ);
    Py_DECREF(shape);
    if (same <= 0) return same;

    PyObject *epoch = PyList_GET_ITEM(g->r.epoch, 0); /* 9 */
    return epoch == d->epoch ? 1 : PyObject_RichCompareBool(epoch, d->epoch, Py_EQ);
}

/* apply(x, plan_arg, *params) */
static PyObject *call_plan(Guard *g, PyObject *x) {
    enum { ON_STACK = 64 };
    PyObject *small[ON_STACK + 2];
    Py_ssize_t n = PyTuple_GET_SIZE(g->d.params);
    PyObject **argv = (n <= ON_STACK) ? small : PyMem_Malloc((size_t)(n + 2) * sizeof(PyObject *));
    if (argv == NULL) return PyErr_NoMemory();
    /* hold our own references: the call may re-enter the fuser and disarm the guard */
    PyObject *apply = g->d.apply, *plan_arg = g->d.plan_arg, *params = g->d.params;
    Py_INCREF(apply);
    Py_INCREF(plan_arg);
    Py_INCREF(params);
    argv[0] = x;
    argv[1] = plan_arg;
    for (Py_ssize_t i = 0; i < n; i++) argv[i + 2] = PyTuple_GET_ITEM(params, i);
    PyObject *out = PyObject_Vectorcall(apply, argv, (size_t)(n + 2), NULL);
    if (argv != small) PyMem_Free(argv);
    Py_DECREF(apply);
    Py_DECREF(plan_arg);
    Py_DECREF(params);
    return out;
}

static PyObject *guard_call(Guard *g, PyObject *x, PyObject *training) {
    int hit = matches(g, x, training);
    if (hit < 0) return NULL;
    if (!hit) {
        PyObject *args[2] = {x, training};
        return PyObject_Vectorcall(g->r.miss, args, 2, NULL);
    }
    g->hits++;
    return call_plan(g, x);
}

/* 1 if there are exactly two positional arguments, else 0 with a TypeError naming `what`. */
static int two_positional(const char *what, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs == 2 && (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0)) return 1;
    PyErr_Format(PyExc_TypeError, "hot guard: %s takes exactly two positional arguments (x, training)", what);
    return 0;
}

static PyObject *guard_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (!two_positional("guard()", PyVectorcall_NARGS(nargsf), kwnames)) return NULL;
    return guard_call((Guard *)self, args[0], args[1]);
}

static PyObject *guard_matches(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (!two_positional("matches()", nargs, kwnames)) return NULL;
    int hit = matches((Guard *)self, args[0], args[1]);
    if (hit < 0) return NULL;
    return PyBool_FromLong(hit);
}

static int is_bool(PyObject *v) { return v == Py_True || v == Py_False; }

static PyObject *guard_arm(Guard *g, PyObject *decision) {
    if (!PyTuple_Check(decision) || PyTuple_GET_SIZE(decision) != N_DECISION) {
        PyErr_Format(PyExc_TypeError, "hot guard: arm() takes a guard.Decision (a tuple of %d fields)", N_DECISION);
        return NULL;
    }
#define ITEM(f) PyObject *f = PyTuple_GET_ITEM(decision, I_##f);
    DECISION_FIELDS(ITEM)
#undef ITEM
    if (!PyTuple_Check(params)) {
        PyErr_SetString(PyExc_TypeError, "hot guard: arm(): the decision's params must be a tuple");
        return NULL;
    }
    if (!is_bool(training) || !is_bool(needs_backward) || !is_bool(is_cuda)) {
        PyErr_SetString(PyExc_TypeError,
                        "hot guard: arm(): the decision's training, needs_backward and is_cuda must be True or False");
        return NULL;
    }
    disarm(g);
#define SET(f) Py_INCREF(f); g->d.f = f;
    DECISION_FIELDS(SET)
#undef SET
    Py_RETURN_NONE;
}

static PyObject *guard_disarm(Guard *g, PyObject *unused) {
    disarm(g);
    Py_RETURN_NONE;
}

static PyObject *guard_take_hits(Guard *g, PyObject *unused) {
    long long hits = g->hits;
    g->hits = 0;
    return PyLong_FromLongLong(hits);
}

static PyObject *guard_armed(Guard *g, void *closure) { return PyBool_FromLong(g->d.state != NULL); }

/* 1 if `t` is a tuple of dicts, else 0 with a TypeError naming `what`. */
static int tuple_of_dicts(PyObject *t, const char *what) {
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyDict_Check(PyTuple_GET_ITEM(t, i))) {
            PyErr_Format(PyExc_TypeError, "hot guard: %s must be a tuple of dicts", what);
            return 0;
        }
    }
    return 1;
}

static PyObject *guard_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
#define NAME(f) #f,
    static char *names[] = {READS_FIELDS(NAME) NULL};
#undef NAME
    Reads r;
    /* the types checked follow READS_FIELDS' order */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!O!OOOO!O!:Guard", names, &r.miss, &PyList_Type, &r.stack,
                                     &PyList_Type, &r.epoch, &r.grad_enabled, &r.any_autocast, &r.compute_dtype,
                                     &PyType_Type, &r.tensor_type, &PyTuple_Type, &r.hook_dicts))
        return NULL;
    if (PyList_GET_SIZE(r.epoch) != 1) {
        PyErr_SetString(PyExc_ValueError, "hot guard: epoch must be a list of one int");
        return NULL;
    }
    if (!tuple_of_dicts(r.hook_dicts, "hook_dicts")) return NULL;
    Guard *g = (Guard *)type->tp_alloc(type, 0);
    if (g == NULL) return NULL;
    g->vectorcall = guard_vectorcall;
#define SET(f) Py_INCREF(r.f); g->r.f = r.f;
    READS_FIELDS(SET)
#undef SET
    return (PyObject *)g;
}

static int guard_traverse(Guard *g, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(g->r.f);
    READS_FIELDS(VISIT)
#undef VISIT
#define VISIT(f) Py_VISIT(g->d.f);
    DECISION_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int guard_clear(Guard *g) {
#define CLEAR(f) Py_CLEAR(g->r.f);
    READS_FIELDS(CLEAR)
#undef CLEAR
    disarm(g);
    return 0;
}

static void guard_dealloc(Guard *g) {
    PyObject_GC_UnTrack(g);
    guard_clear(g);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static PyMethodDef guard_methods[] = {
    {"arm", (PyCFunction)guard_arm, METH_O, "arm(decision): hold a guard.Decision, the decision to reuse"},
    {"disarm", (PyCFunction)guard_disarm, METH_NOARGS,
     "forget the armed decision: the next call takes the Python path"},
    {"matches", (PyCFunction)(void (*)(void))guard_matches, METH_FASTCALL | METH_KEYWORDS,
     "matches(x, training) -> whether the armed plan applies to guard(x, training) (the hit check alone)"},
    {"take_hits", (PyCFunction)guard_take_hits, METH_NOARGS, "the hits counted since the last call, and reset to 0"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef guard_getset[] = {
    {"armed", (getter)guard_armed, NULL, "whether a decision is armed", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject GuardType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "te_fuser.ops._hot_guard.Guard",
    .tp_basicsize = sizeof(Guard),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "The op fuser's compiled hot path: guard(x, training) -> the published plan's output.",
    .tp_new = guard_new,
    .tp_dealloc = (destructor)guard_dealloc,
    .tp_traverse = (traverseproc)guard_traverse,
    .tp_clear = (inquiry)guard_clear,
    .tp_vectorcall_offset = offsetof(Guard, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_methods = guard_methods,
    .tp_getset = guard_getset,
};

/* null_plan(x, *anything) -> x: a plan that does nothing, at the cost of a C call.
 * Benchmarks put it in place of the plan to time the decision alone. */
static PyObject *null_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "null_plan: needs at least one argument");
        return NULL;
    }
    Py_INCREF(args[0]);
    return args[0];
}

static PyMethodDef module_methods[] = {
    {"null_plan", (PyCFunction)(void (*)(void))null_plan, METH_FASTCALL,
     "null_plan(x, *anything) -> x: a plan that does nothing (benchmarks time the decision with it)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_hot_guard", "The op fuser's compiled hot path.", -1, module_methods,
};

/* ("a", "b", ...): the names of a field list, for hot_guard.py's check against guard.py. */
static PyObject *names_of(const char *const *names, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyUnicode_FromString(names[i]);
        if (s == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, s);
    }
    return t;
}

PyMODINIT_FUNC PyInit__hot_guard(void) {
    if (PyType_Ready(&GuardType) < 0) return NULL;
    str_requires_grad = PyUnicode_InternFromString("requires_grad");
    str_dtype = PyUnicode_InternFromString("dtype");
    str_is_cuda = PyUnicode_InternFromString("is_cuda");
    str_shape = PyUnicode_InternFromString("shape");
    if (!str_requires_grad || !str_dtype || !str_is_cuda || !str_shape) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
#define NAME(f) #f,
    static const char *const reads[] = {READS_FIELDS(NAME)};
    static const char *const decision[] = {DECISION_FIELDS(NAME)};
#undef NAME
    PyObject *reads_names = names_of(reads, sizeof(reads) / sizeof(reads[0]));
    PyObject *decision_names = names_of(decision, N_DECISION);
    int failed = reads_names == NULL || decision_names == NULL || PyModule_AddObjectRef(m, "READS", reads_names) < 0 ||
                 PyModule_AddObjectRef(m, "DECISION", decision_names) < 0 ||
                 PyModule_AddObjectRef(m, "Guard", (PyObject *)&GuardType) < 0;
    Py_XDECREF(reads_names);
    Py_XDECREF(decision_names);
    if (failed) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
