#pragma once
/**
 * @file check.hpp
 * @brief A minimal self-contained test harness for the C++ unit tests (no external framework:
 *        the build must work offline). TEST(name) registers a case; CHECK* record failures and
 *        carry on; CHECK_THROWS stops the case when the expression does not throw the type.
 *        run_all() returns the process exit status for ctest.
 */
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace pyckpt::test {

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& registry() {
  static std::vector<Case> cases;
  return cases;
}

inline int& failures() {
  static int n = 0;
  return n;
}

struct Registrar {
  Registrar(const char* name, std::function<void()> fn) {
    registry().push_back(Case{name, std::move(fn)});
  }
};

inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
  ++failures();
}

/** @brief Runs every case (or those whose name contains argv[1]); returns 0 when all passed. */
inline int run_all(int argc, char** argv) {
  int ran = 0;
  for (const Case& c : registry()) {
    if (argc > 1 && std::string(c.name).find(argv[1]) == std::string::npos) continue;
    const int before = failures();
    try {
      c.fn();
    } catch (const std::exception& e) {
      fail(__FILE__, __LINE__, std::string("unexpected exception in ") + c.name + ": " + e.what());
    } catch (...) {
      fail(__FILE__, __LINE__, std::string("unexpected non-std exception in ") + c.name);
    }
    std::fprintf(stderr, "[%s] %s\n", failures() == before ? " ok " : "FAIL", c.name);
    ++ran;
  }
  std::fprintf(stderr, "%d cases, %d failed checks\n", ran, failures());
  return (failures() == 0 && ran > 0) ? 0 : 1;
}

}  // namespace pyckpt::test

#define PYCKPT_TEST_CAT2(a, b) a##b
#define PYCKPT_TEST_CAT(a, b) PYCKPT_TEST_CAT2(a, b)

/** @brief Defines and registers a test case. */
#define TEST(name)                                                         \
  static void PYCKPT_TEST_CAT(test_fn_, name)();                           \
  static const ::pyckpt::test::Registrar PYCKPT_TEST_CAT(test_reg_, name)( \
      #name, &PYCKPT_TEST_CAT(test_fn_, name));                            \
  static void PYCKPT_TEST_CAT(test_fn_, name)()

/** @brief Records a failure when `cond` is false. */
#define CHECK(cond)                                               \
  do {                                                            \
    if (!(cond)) ::pyckpt::test::fail(__FILE__, __LINE__, #cond); \
  } while (0)

/**
 * @brief Checks that `expr` throws `type` and that its what() contains `needle` (may be "").
 */
#define CHECK_THROWS(expr, type, needle)                                                   \
  do {                                                                                     \
    bool caught_ = false;                                                                  \
    try {                                                                                  \
      (void)(expr);                                                                        \
    } catch (const type& e_) {                                                             \
      caught_ = true;                                                                      \
      if (std::string(e_.what()).find(needle) == std::string::npos) {                      \
        ::pyckpt::test::fail(                                                              \
            __FILE__, __LINE__,                                                            \
            std::string(#expr " threw: ") + e_.what() + " (want '" + (needle) + "')");     \
      }                                                                                    \
    } catch (const std::exception& e_) {                                                   \
      ::pyckpt::test::fail(__FILE__, __LINE__,                                             \
                           std::string(#expr " threw another type: ") + e_.what());        \
      caught_ = true;                                                                      \
    }                                                                                      \
    if (!caught_) ::pyckpt::test::fail(__FILE__, __LINE__, #expr " did not throw " #type); \
  } while (0)

#define PYCKPT_TEST_MAIN \
  int main(int argc, char** argv) { return ::pyckpt::test::run_all(argc, argv); }
