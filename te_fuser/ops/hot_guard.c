/* The op fuser's hot path, compiled: the unchanged-plan check and the call into
 * the published plan, with no Python frame in between.
 *
 * A Guard belongs to one OperationFuser. The fuser's Python path decides which
 * plan runs (building one when needed) and then *arms* the guard with that
 * decision: the te.autocast state that selected the plan, the plan's conditions
 * (needs backward, compute dtype, training, CUDA or not), the quantizer-install
 * epoch it saw, and the call that runs it. guard(x, training) checks exactly the
 * conditions that the Python path checks, reading the same state in the same way
 * (grad mode, x.requires_grad and the parameters', torch.autocast, x.dtype,
 * x.is_cuda, x.shape), and on a match counts a hit (in a C counter the fuser takes
 * into its statistics when they are read) and calls the plan. Anything
 * else, and any input it does not handle (not a tensor), goes to the Python path
 * (`miss`), which decides afresh and re-arms. A hit is therefore always a case the
 * Python path would also have called a hit with the same plan.
 *
 * The epoch is bumped whenever any op installs quantizers or has a Parameter or
 * module hook registered or removed (ops/op.py), so one comparison catches
 * quantizers installed from elsewhere, a replaced Parameter and a new hook; the
 * Python path then reads the parameter and hook dicts themselves (it never arms
 * the guard while an op has hooks). torch's global forward hook dicts must be
 * empty. The fuser disarms the guard whenever it publishes another plan.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    /* fixed at construction */
    PyObject *miss;          /* (x, training) -> output: the Python path, which re-arms */
    PyObject *stack;         /* list: te.autocast's states, the last one in force */
    PyObject *epoch;         /* list of one int: bumped whenever any op installs quantizers */
    PyObject *grad_enabled;  /* torch.is_grad_enabled */
    PyObject *any_autocast;  /* torch._C._is_any_autocast_enabled */
    PyObject *compute_dtype; /* x -> the dtype torch.autocast computes x's ops in */
    PyObject *tensor_type;   /* torch.Tensor */
    PyObject *hook_dicts;    /* tuple of dicts that must be empty: torch's global forward hooks */
    /* the armed decision; state == NULL: disarmed */
    PyObject *state;
    PyObject *apply;         /* the autograd Function's apply */
    PyObject *plan_arg;      /* (fuser, plan) */
    PyObject *params;        /* tuple: the fuser's flat parameters */
    PyObject *dtype;
    PyObject *epoch_value;
    PyObject *training;      /* Py_True or Py_False */
    PyObject *is_cuda;       /* Py_True or Py_False */
    PyObject *in_shape;      /* the validated input shape (a torch.Size) */
    int needs_backward;
    long long hits;          /* hits since the fuser last took them (take_hits) */
} Guard;

static PyObject *str_requires_grad, *str_dtype, *str_is_cuda, *str_shape;

#define ARMED_FIELDS(X) X(state) X(apply) X(plan_arg) X(params) X(dtype) X(epoch_value) X(training) X(is_cuda) X(in_shape)

static void disarm(Guard *g) {
#define CLEAR(f) Py_CLEAR(g->f);
    ARMED_FIELDS(CLEAR)
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
    Py_ssize_t n = PyTuple_GET_SIZE(g->hook_dicts);
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyDict_GET_SIZE(PyTuple_GET_ITEM(g->hook_dicts, i)) != 0) return 0;
    return 1;
}

/* 1: the armed plan applies to this call; 0: it does not; -1: error. */
static int matches(Guard *g, PyObject *x, PyObject *training) {
    if (g->state == NULL || training != g->training || !PyObject_TypeCheck(x, (PyTypeObject *)g->tensor_type))
        return 0;
    Py_ssize_t depth = PyList_GET_SIZE(g->stack);
    if (depth == 0 || PyList_GET_ITEM(g->stack, depth - 1) != g->state) return 0;
    if (!no_hooks(g)) return 0;

    PyObject *grad = PyObject_CallNoArgs(g->grad_enabled);
    if (grad == NULL) return -1;
    int needs_backward = (grad == Py_True);
    Py_DECREF(grad);
    if (needs_backward) {
        int r = requires_grad(x);
        if (r < 0) return -1;
        Py_ssize_t n = PyTuple_GET_SIZE(g->params);
        for (Py_ssize_t i = 0; !r && i < n; i++) {
            r = requires_grad(PyTuple_GET_ITEM(g->params, i));
            if (r < 0) return -1;
        }
        needs_backward = r;
    }
    if (needs_backward != g->needs_backward) return 0;

    PyObject *autocast = PyObject_CallNoArgs(g->any_autocast);
    if (autocast == NULL) return -1;
    PyObject *dtype = (autocast == Py_True) ? PyObject_CallOneArg(g->compute_dtype, x) : PyObject_GetAttr(x, str_dtype);
    Py_DECREF(autocast);
    if (dtype == NULL) return -1;
    int same = (dtype == g->dtype);
    Py_DECREF(dtype);
    if (!same) return 0;

    PyObject *is_cuda = PyObject_GetAttr(x, str_is_cuda);
    if (is_cuda == NULL) return -1;
    same = (is_cuda == g->is_cuda);
    Py_DECREF(is_cuda);
    if (!same) return 0;

    PyObject *shape = PyObject_GetAttr(x, str_shape);
    if (shape == NULL) return -1;
    same = PyObject_RichCompareBool(shape, g->in_shape, Py_EQ);
    Py_DECREF(shape);
    if (same <= 0) return same;

    PyObject *epoch = PyList_GET_ITEM(g->epoch, 0);
    return epoch == g->epoch_value ? 1 : PyObject_RichCompareBool(epoch, g->epoch_value, Py_EQ);
}

/* apply(x, (fuser, plan), *params) */
static PyObject *call_plan(Guard *g, PyObject *x) {
    enum { ON_STACK = 64 };
    PyObject *small[ON_STACK + 2];
    Py_ssize_t n = PyTuple_GET_SIZE(g->params);
    PyObject **argv = (n <= ON_STACK) ? small : PyMem_Malloc((size_t)(n + 2) * sizeof(PyObject *));
    if (argv == NULL) return PyErr_NoMemory();
    /* hold our own references: the call may re-enter the fuser and disarm the guard */
    PyObject *apply = g->apply, *plan_arg = g->plan_arg, *params = g->params;
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
        return PyObject_Vectorcall(g->miss, args, 2, NULL);
    }
    g->hits++;
    return call_plan(g, x);
}

static PyObject *guard_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 2 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "hot guard: takes exactly two positional arguments (x, training)");
        return NULL;
    }
    return guard_call((Guard *)self, args[0], args[1]);
}

static PyObject *guard_arm(Guard *g, PyObject *args) {
    PyObject *state, *apply, *plan_arg, *params, *dtype, *epoch_value, *training, *is_cuda, *in_shape;
    int needs_backward;
    if (!PyArg_ParseTuple(args, "OOOO!pOOOOO:arm", &state, &apply, &plan_arg, &PyTuple_Type, &params, &needs_backward,
                          &dtype, &training, &is_cuda, &epoch_value, &in_shape))
        return NULL;
    if ((training != Py_True && training != Py_False) || (is_cuda != Py_True && is_cuda != Py_False)) {
        PyErr_SetString(PyExc_TypeError, "hot guard: arm(training=, is_cuda=) must be True or False");
        return NULL;
    }
    disarm(g);
#define SET(f) Py_INCREF(f); g->f = f;
    ARMED_FIELDS(SET)
#undef SET
    g->needs_backward = needs_backward;
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

static PyObject *guard_armed(Guard *g, void *closure) { return PyBool_FromLong(g->state != NULL); }

#define FIXED_FIELDS(X) X(miss) X(stack) X(epoch) X(grad_enabled) X(any_autocast) X(compute_dtype) X(tensor_type) \
    X(hook_dicts)

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
    static char *names[] = {"miss", "stack", "epoch", "grad_enabled", "any_autocast", "compute_dtype",
                            "tensor_type", "hook_dicts", NULL};
    PyObject *miss, *stack, *epoch, *grad_enabled, *any_autocast, *compute_dtype, *tensor_type, *hook_dicts;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!O!OOOO!O!:Guard", names, &miss, &PyList_Type, &stack,
                                     &PyList_Type, &epoch, &grad_enabled, &any_autocast, &compute_dtype,
                                     &PyType_Type, &tensor_type, &PyTuple_Type, &hook_dicts))
        return NULL;
    if (PyList_GET_SIZE(epoch) != 1) {
        PyErr_SetString(PyExc_ValueError, "hot guard: epoch must be a list of one int");
        return NULL;
    }
    if (!tuple_of_dicts(hook_dicts, "hook_dicts")) return NULL;
    Guard *g = (Guard *)type->tp_alloc(type, 0);
    if (g == NULL) return NULL;
    g->vectorcall = guard_vectorcall;
#define SET(f) Py_INCREF(f); g->f = f;
    FIXED_FIELDS(SET)
#undef SET
    return (PyObject *)g;
}

static int guard_traverse(Guard *g, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(g->f);
    FIXED_FIELDS(VISIT)
    ARMED_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int guard_clear(Guard *g) {
#define CLEAR(f) Py_CLEAR(g->f);
    FIXED_FIELDS(CLEAR)
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
    {"arm", (PyCFunction)guard_arm, METH_VARARGS,
     "arm(state, apply, plan_arg, params, needs_backward, dtype, training, is_cuda, epoch, in_shape): the decision to reuse"},
    {"disarm", (PyCFunction)guard_disarm, METH_NOARGS, "forget the armed decision: the next call takes the Python path"},
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

PyMODINIT_FUNC PyInit__hot_guard(void) {
    if (PyType_Ready(&GuardType) < 0) return NULL;
    str_requires_grad = PyUnicode_InternFromString("requires_grad");
    str_dtype = PyUnicode_InternFromString("dtype");
    str_is_cuda = PyUnicode_InternFromString("is_cuda");
    str_shape = PyUnicode_InternFromString("shape");
    if (!str_requires_grad || !str_dtype || !str_is_cuda || !str_shape) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Guard", (PyObject *)&GuardType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
