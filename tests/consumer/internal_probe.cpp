// Must NOT compile against terrace::terrace: internal headers are not part of the package.
#include "src/store/store_impl.h"

int main() { return 0; }
